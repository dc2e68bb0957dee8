"""The compiled training step (`train.compile`): whether it applies on a device, and the compiled model the
trainer steps through (forward and backward; the update is the optimizer's own fused or foreach kernel)."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# reduce-overhead: compiled, and each step replayed as CUDA graphs (torch.compile's mode of that name; the
# shapes must stay static, as the trainer's full batches and the static layout keep them)
COMPILE_CHOICES = ("auto", "on", "off", "reduce-overhead")
CUDA_GRAPHS = "reduce-overhead"
# inductor: generated kernels (Triton on CUDA, C++ on CPU); tests substitute a cheaper backend
BACKEND = "inductor"


def wants_compile(setting: str, device: torch.device) -> bool:
    """`train.compile`: on, reduce-overhead, off, or auto (on for CUDA, off elsewhere: on a CPU the eager
    step is the faster one for the sizes trained there, and compiling costs minutes)."""
    if setting not in COMPILE_CHOICES:
        raise ValueError(f"train.compile={setting!r} must be one of {list(COMPILE_CHOICES)}")
    return setting in ("on", CUDA_GRAPHS) or (setting == "auto" and device.type == "cuda")


def compile_mode(setting: str, device: torch.device) -> str | None:
    """torch.compile's `mode` for `train.compile`: "reduce-overhead" (CUDA graphs) where asked on CUDA;
    elsewhere the default (CUDA graphs need a CUDA device: a CPU compiles plainly, and says so once)."""
    if setting != CUDA_GRAPHS:
        return None
    if device.type != "cuda":
        log.warning(
            "train.compile=%s: CUDA graphs need a CUDA device; compiling the step without them on %s",
            setting,
            device,
        )
        return None
    return CUDA_GRAPHS


def compile_model(model: torch.nn.Module, mode: str | None = None) -> torch.nn.Module:
    """`model` (plain or DistributedDataParallel) compiled lazily: the first call traces and compiles, a
    new input shape recompiles (with dynamic sizes from the second one on). The parameters stay the
    model's own, so checkpoints and the optimizer see no difference. `mode`: torch.compile's (the
    benchmarks try "reduce-overhead", CUDA graphs; the trainer keeps the default)."""
    return torch.compile(model, backend=BACKEND, mode=mode)


def failure_line(exc: BaseException) -> str:
    """One line for the log when the compiled step cannot run: the first line of the error at the root
    (torch's wrappers such as BackendCompilerFailed put theirs first and the cause below)."""
    while (inner := getattr(exc, "inner_exception", None) or exc.__cause__) is not None:
        exc = inner
    first = (str(exc).strip().splitlines() or [""])[0]
    first = first if len(first) <= 200 else f"{first[:197]}..."
    return (
        f"train.compile: the compiled step failed ({type(exc).__name__}: {first}); "
        "training on without compiling (set train.compile=off to skip the attempt)"
    )
