"""How a collated batch leaves a DataLoader worker: its big tensors in the worker's reused shared buffers
(one file-descriptor round trip each), the small ones packed into the message itself.

Left to torch, every tensor of a batch (17 in a pre-training batch) is moved into a fresh shared-memory
block and sent as a handle the training process fetches from the worker's fd-sharing thread, which waits
for the worker's GIL (up to 5 ms a switch): ~35 ms per batch in the training process, plus the fresh
blocks' page faults in the worker. The training process receives a plain dict of the same tensors."""

from __future__ import annotations

import torch

from pipelines.data.shared_memory import POOLED, Buffer, reduce_pooled, worker_pool

# a tensor at least this big travels in a shared buffer; smaller ones are copied into the message
INLINE_BYTES = 1 << 20
_ALIGN = 16


class WorkerBatch(dict):
    """A collated batch (a dict) as it leaves a DataLoader worker; unpickles as a plain dict."""

    def __copy__(self) -> WorkerBatch:
        # DataLoader's `default_convert` copies the batch in the worker: it must stay a WorkerBatch
        return WorkerBatch(self)

    def __reduce__(self):
        shared: dict = {}
        other: dict = {}
        layout: list[tuple[str, torch.dtype, tuple[int, ...], int, int]] = []
        small: list[torch.Tensor] = []
        size = 0
        pool = worker_pool()
        taken: set[int] = set()  # buffers shipped already: each is released by the one tensor on it
        for key, value in self.items():
            if not _plain_tensor(value):
                other[key] = value
            elif not POOLED and value.nbytes >= INLINE_BYTES:
                shared[key] = value  # torch's own way: a fresh shared block
            elif value.nbytes >= INLINE_BYTES:
                buf = pool.owner(value) if value.is_contiguous() else None
                if buf is not None and id(buf) in taken:
                    buf = None
                if buf is not None:
                    taken.add(id(buf))
                shared[key] = _Shipped(value, buf)
            else:
                layout.append((key, value.dtype, tuple(value.shape), size, value.nbytes))
                small.append(value)
                size += -(-value.nbytes // _ALIGN) * _ALIGN
        blob = bytearray(size)
        if size:
            dst = torch.frombuffer(blob, dtype=torch.uint8)
            for (_, _, _, at, nbytes), tensor in zip(layout, small, strict=True):
                if nbytes:
                    dst[at : at + nbytes].copy_(tensor.contiguous().reshape(-1).view(torch.uint8))
        return _unpack, (list(self), shared, other, blob, layout)


def for_transfer(batch):
    """`batch` as it should leave a DataLoader worker: a dict becomes a `WorkerBatch`, else unchanged."""
    return WorkerBatch(batch) if type(batch) is dict else batch


class _Shipped:
    """A big tensor on its way: pickled as its place in a shared buffer `buf`, or, with None, copied
    into a fresh one of the pool first (made elsewhere, or sharing a buffer already shipped)."""

    __slots__ = ("tensor", "buf")

    def __init__(self, tensor: torch.Tensor, buf: Buffer | None):
        self.tensor, self.buf = tensor, buf

    def __reduce__(self):
        tensor, buf = self.tensor, self.buf
        if buf is None:
            pool = worker_pool()
            copy = torch.from_numpy(pool.take(tuple(tensor.shape), _numpy_dtype(tensor.dtype)))
            copy.copy_(tensor)
            tensor, buf = copy, pool.owner(copy)
        return reduce_pooled(tensor, buf)


def _numpy_dtype(dtype: torch.dtype):
    return torch.empty(0, dtype=dtype).numpy().dtype


def _plain_tensor(value) -> bool:
    return (
        type(value) is torch.Tensor
        and value.device.type == "cpu"
        and value.layout == torch.strided
        and not value.requires_grad
        and value.dtype != torch.bfloat16  # no numpy dtype for a copy into a pooled buffer
    )


def _unpack(keys: list, shared: dict, other: dict, blob: bytearray, layout: list) -> dict:
    """The plain dict a `WorkerBatch` was, in the training process (its small tensors view `blob`)."""
    flat = torch.frombuffer(blob, dtype=torch.uint8) if len(blob) else None
    small = {}
    for key, dtype, shape, at, nbytes in layout:
        raw = flat[at : at + nbytes] if nbytes else torch.empty(0, dtype=torch.uint8)
        small[key] = raw.view(dtype).reshape(shape)
    return {k: shared[k] if k in shared else small[k] if k in small else other[k] for k in keys}
