"""Other libraries' weight files: tensors-only reading, and a report of what became of every name."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from .files import regular_file

log = logging.getLogger(__name__)


@dataclass
class ConversionReport:
    """Every weight name of the file and of the model lands in exactly one list."""

    source: str
    loaded: list[str] = field(default_factory=list)  # the file's names that filled a model weight
    missing: list[str] = field(default_factory=list)  # the model's names absent from the file
    unexpected: list[str] = field(default_factory=list)  # the file's names with no place in the model
    tied: list[str] = field(default_factory=list)  # the file's second names of one weight, checked equal

    def log(self) -> None:
        log.info("%s: %d weights loaded", self.source, len(self.loaded))
        if self.tied:
            log.info("%s: %d tied aliases checked and dropped: %s", self.source, len(self.tied), self.tied)
        if self.missing:
            log.warning(
                "%s: %d weights missing, initialised: %s", self.source, len(self.missing), self.missing
            )
        if self.unexpected:
            log.warning("%s: %d weights not used: %s", self.source, len(self.unexpected), self.unexpected)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file or a tensors-only torch file (`weights_only=True`; `{'state_dict': ...}` too)."""
    regular_file(path, "weights")
    try:
        if path.suffix == ".safetensors":
            return load_file(str(path))
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch and safetensors raise many types for a damaged or foreign file
        reason = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        kind = "safetensors file" if path.suffix == ".safetensors" else "tensors-only checkpoint"
        raise ValueError(f"{path}: cannot be read as a {kind} ({type(err).__name__}: {reason})") from err
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: expected a state dict of tensors")
    return state
