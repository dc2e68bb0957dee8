"""Refuse a model that cannot be trained in this machine's memory before any of its tensors exist.

The model is built once on the meta device (shapes only, no storage): its parameters, their gradients and
the optimizer's state (two float32 copies for AdamW/BertAdam, one for SGD with momentum) are a lower
bound on what training needs, activations not counted. A configuration that passes every range but is
still too big (a 65536-wide, 256-layer typo, or DALL-E's paper preset on a laptop) is then one line, not
the operating system's out-of-memory kill halfway through allocating it."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import psutil
import torch

log = logging.getLogger(__name__)


class ModelTooLarge(ValueError):
    """Training this configuration cannot fit in the device's free memory."""


# float32 copies kept per parameter by each optimizer, besides the weight and its gradient
OPTIMIZER_STATES = {"adamw": 2, "bertadam": 2, "sgd": 1}


def training_bytes(model: torch.nn.Module, optimizer: str, momentum: float = 0.0) -> int:
    """Bytes of weights + gradients + optimizer state (float32) + buffers: a lower bound for training."""
    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    states = OPTIMIZER_STATES.get(optimizer, 2)
    if optimizer == "sgd" and not momentum:
        states = 0
    return params * 4 * (2 + states) + buffers


def free_bytes(device: torch.device) -> int:
    """Memory a new allocation on `device` can use now."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


@contextlib.contextmanager
def _quiet_logs() -> Iterator[None]:
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)


def check_model_fits(build: Any, optimizer: str, momentum: float, device: torch.device) -> None:
    """Build `build()` on the meta device and raise a one-line ModelTooLarge (a ValueError, as every
    refused setting) when training it needs more than `device` has free. A model that cannot be built on
    the meta device (one that computes with real tensors while it is built) is not checked here: its real
    build reports its own errors."""
    try:
        # quietly: the real build below logs its own warnings (random weights) once
        with torch.device("meta"), warnings.catch_warnings(), _quiet_logs():
            warnings.simplefilter("ignore")
            probe = build()
    except Exception as exc:  # noqa: BLE001 -- the real build below raises whatever is wrong
        log.debug("model size not checked before building (%s)", exc)
        return
    need = training_bytes(probe, optimizer, momentum)
    free = free_bytes(device)
    if need > free:
        params = sum(p.numel() for p in probe.parameters())
        raise ModelTooLarge(
            f"the model has {params / 1e6:,.1f} M parameters: training it with {optimizer} needs at least "
            f"{need / 2**30:,.1f} GiB (weights, gradients, optimizer state), more than the "
            f"{free / 2**30:,.1f} GiB free on {device}; choose a smaller preset or smaller task.model sizes"
        )
