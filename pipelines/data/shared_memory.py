"""Batch memory a DataLoader worker shares with the training process, reused from batch to batch.

A fresh shared-memory block per batch costs more than building the batch: the kernel allocates, zeroes
and later frees every 4 KB page of it (~30 ms of CPU for the 38 MB of a base-preset batch of 256). A
worker here keeps a few buffers (memfd files) and hands the same ones out again: the first word of each
says whether the training process still holds it, set by the worker when it fills the buffer and cleared
in the training process when the last tensor viewing the buffer there is freed. A buffer never received
(a batch dropped at shutdown) stays held and goes when the worker exits."""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from multiprocessing.reduction import DupFd

import numpy as np
import torch
from torch.utils.data import get_worker_info

from storage.batch import Allocator

HEADER = 64  # bytes before a buffer's array: word 0 is 1 while a process other than the worker holds it
KEEP_FREE = 4  # free buffers a worker keeps for the next batches; more are closed


class Buffer:
    """One memfd mapping: `HEADER` bytes, then room for `capacity` bytes of array."""

    def __init__(self, capacity: int):
        _check_room(capacity)
        self.capacity = capacity
        self.fd = os.memfd_create("xmodal-batch", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, HEADER + capacity)
        self.map = mmap.mmap(self.fd, HEADER + capacity)
        self.flag = np.frombuffer(self.map, np.uint64, 1)
        self.start = self.flag.ctypes.data + HEADER
        self.lease = 0  # counts the times it was handed out
        self.sent = False  # this lease was pickled to the training process: its release clears `flag`

    @property
    def held(self) -> bool:
        return bool(self.flag[0])

    def close(self) -> bool:
        """Unmap and close; False (and kept open) while an array of it is still alive here."""
        try:
            self.map.close()
        except BufferError:
            return False
        os.close(self.fd)
        return True


class BufferPool:
    """A worker's shared buffers: `take` gives an array in a free one, `owner` finds a tensor's buffer."""

    def __init__(self) -> None:
        self.buffers: list[Buffer] = []
        # the worker's loop and its queue's feeder thread (copying a tensor in while pickling) both take
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialised array of `shape` in a buffer no one else holds (a new one if none fits)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        with self._lock:
            free = [b for b in self.buffers if not b.held]
            fits = [b for b in free if b.capacity >= nbytes]
            buf = min(fits, key=lambda b: b.capacity) if fits else None
            for extra in [b for b in free if b is not buf][KEEP_FREE:]:
                del extra.flag  # the map cannot close while this view of it lives
                if extra.close():
                    self.buffers.remove(extra)
                else:
                    extra.flag = np.frombuffer(extra.map, np.uint64, 1)
            if buf is None:
                buf = Buffer(nbytes)
                self.buffers.append(buf)
            buf.flag[0], buf.sent = 1, False
            buf.lease += 1
        flat = np.frombuffer(buf.map, dtype, nbytes // dtype.itemsize if dtype.itemsize else 0, HEADER)
        # every view of the array keeps `flat` alive (numpy's own base holds the map, not a view we
        # could watch); dropped unsent (a collate that copied it, an error), it is free again at once
        weakref.finalize(flat, _dropped, buf, buf.lease)
        return flat.reshape(shape)

    def owner(self, tensor: torch.Tensor) -> Buffer | None:
        """The buffer `tensor`'s memory lies in, None if none does."""
        at = tensor.data_ptr()
        for buf in self.buffers:
            if buf.start <= at and at + tensor.nbytes <= buf.start + buf.capacity:
                return buf
        return None


def _dropped(buf: Buffer, lease: int) -> None:
    # a later lease's batch may be in flight by now: only the lease still current is freed here
    flag = getattr(buf, "flag", None)  # None while `take` closes it
    if buf.lease == lease and not buf.sent and flag is not None and not buf.map.closed:
        flag[0] = 0


_pool: tuple[int, BufferPool] | None = None


def worker_pool() -> BufferPool:
    """This process's pool (one per DataLoader worker; a forked child starts its own)."""
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        _pool = (os.getpid(), BufferPool())
    return _pool[1]


# memfd files are Linux's; elsewhere batches cross the way torch sends tensors
POOLED = hasattr(os, "memfd_create")


def batch_allocator() -> Allocator:
    """Uninitialised batch arrays: in a DataLoader worker from its shared `worker_pool`, elsewhere
    `np.empty`."""
    return worker_pool().take if POOLED and get_worker_info() is not None else np.empty


def reduce_pooled(tensor: torch.Tensor, buf: Buffer):
    """Pickling of a contiguous `tensor` lying in `buf`: the buffer's file descriptor (one round trip
    to the worker) and where the tensor lies in it; the training process maps the buffer."""
    buf.sent = True
    offset = tensor.data_ptr() - buf.start + HEADER
    return _rebuild, (DupFd(buf.fd), HEADER + buf.capacity, offset, tensor.dtype, tuple(tensor.shape))


def _rebuild(fd_holder, size: int, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    fd = fd_holder.detach()
    try:
        whole = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
    view = memoryview(whole)[offset : offset + nbytes]
    # the tensor's storage holds `view`: when the last tensor on this memory is freed, the worker may
    # fill the buffer again
    weakref.finalize(view, _release, whole)
    return torch.frombuffer(view, dtype=dtype).reshape(shape)


def _release(whole: mmap.mmap) -> None:
    whole[:8] = bytes(8)


def _check_room(nbytes: int) -> None:
    """Refuse a buffer larger than the memory available: its pages are granted lazily, and the first write
    past what there is would kill the worker."""
    available = _memory_available()
    if available is not None and nbytes > available:
        raise ValueError(
            f"a batch array of {nbytes} bytes exceeds the {available} bytes of memory available for "
            "shared batches: lower train.batch_size or train.loader_workers"
        )


def _memory_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, None where there is none to read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None
