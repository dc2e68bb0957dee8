"""Batch arrays a DataLoader worker hands over without a copy: numpy views of torch shared memory.

A tensor made from an ordinary array is copied into shared memory when the worker sends it to the
training process (~40 MB per pre-training batch of 256); one already there is sent as a handle."""

from __future__ import annotations

import math
import os

import numpy as np
import torch
from torch.utils.data import get_worker_info

from storage.batch import Allocator

SHM_DIR = "/dev/shm"


def shared_zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zero-filled array in a fresh torch shared-memory block (the kernel zeroes new pages). A block
    larger than the free shared memory is refused: its pages would be granted lazily and the first write
    past the free space kills the worker with SIGBUS."""
    torch_dtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    free = _shm_free()
    if free is not None and nbytes > free:
        raise ValueError(
            f"a batch array of shape {tuple(shape)} ({nbytes} bytes) exceeds the {free} bytes free in "
            f"{SHM_DIR}: lower train.batch_size or train.loader_workers, or enlarge {SHM_DIR} "
            "(docker run --shm-size)"
        )
    storage = torch.UntypedStorage._new_shared(max(nbytes, 1))
    return torch.empty(0, dtype=torch_dtype).set_(storage, 0, shape).numpy()


def batch_allocator() -> Allocator:
    """`shared_zeros` inside a DataLoader worker, plain `np.zeros` elsewhere."""
    return shared_zeros if get_worker_info() is not None else np.zeros


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """`array` as a tensor: the shared-memory tensor it views when it spans one whole (so sending it
    copies nothing), else `torch.from_numpy`."""
    base = array.base
    if (
        isinstance(base, torch.Tensor)
        and base.is_shared()
        and array.flags.c_contiguous
        and array.nbytes == base.untyped_storage().nbytes()
        and array.ctypes.data == base.data_ptr()
    ):
        return base.view(array.shape)
    return torch.from_numpy(array)


def _shm_free() -> int | None:
    """Bytes free in the shared-memory file system, None where there is none to ask."""
    try:
        info = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize
