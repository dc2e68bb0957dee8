"""The one device rule every command follows: `auto` (the default everywhere) is this worker's GPU if any,
else the CPU; anything else is a torch device name (cpu, cuda, cuda:N)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported when a device is picked, not when a parser names the default
    import torch

DEFAULT_DEVICE = "auto"
DEVICE_HELP = "cpu, cuda or cuda:N (default: auto, a GPU if any, else cpu)"


def pick_device(name: str | torch.device = DEFAULT_DEVICE) -> torch.device:
    """`name` as a torch.device; `auto` is the GPU of this worker's LOCAL_RANK if CUDA is available."""
    import torch

    if isinstance(name, torch.device):
        return name
    if name != "auto":
        try:
            return torch.device(name)
        except RuntimeError as exc:  # torch's message for "gpu" is a page; ours is one line
            raise ValueError(f"--device {name!r} is not a device; give {DEVICE_HELP}") from exc
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")
