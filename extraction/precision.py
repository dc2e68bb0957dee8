"""What float32 means on CUDA: IEEE float32, or TF32 matmuls and convolutions (Ampere and later)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def tf32_flags() -> dict[str, bool]:
    """Whether CUDA float32 matmuls (cuBLAS) and convolutions (cuDNN) may run in TF32 right now."""
    return {
        "matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn": bool(torch.backends.cudnn.allow_tf32),
    }


@contextlib.contextmanager
def float32_precision(tf32: bool) -> Iterator[None]:
    """Run the block with TF32 allowed (`tf32=True`) or off (IEEE float32) for CUDA matmuls and
    convolutions, then put back what was set before.

    TF32 keeps 10 mantissa bits (about 1e-3 relative error per product): fast, but enough to reorder
    near-tied regions. PyTorch's own defaults differ (matmuls off, cuDNN convolutions on), so both are
    set explicitly. The flags are process-wide: blocks in several threads at once must agree on `tf32`.
    """
    before = tf32_flags()
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before["matmul"]
        torch.backends.cudnn.allow_tf32 = before["cudnn"]


@contextlib.contextmanager
def deterministic_cudnn() -> Iterator[None]:
    """Run the block with cuDNN's deterministic algorithms and no autotuning, then put back what was set.

    cuDNN then picks one algorithm per shape by its heuristics, the same on every run: two runs write the
    same bits (an autotuner's choice can change with timing noise). Measured on res5 over 300 RoIs in
    float32 (H200): 44 ms deterministic, 55 ms not. Process-wide flags, as in `float32_precision`."""
    before = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before
