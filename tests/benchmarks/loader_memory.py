"""What the scale benchmarks share: a small store standing for every image, and a training set driven
through the trainer's real loader while the training process's and each worker's memory are probed.

Memory is read from /proc: a process's `smaps_rollup` (Private_Dirty, Anonymous, Pss) and its own
`status` (VmHWM: ru_maxrss would also count the parent's peak at the fork)."""

from __future__ import annotations

import time

import numpy as np


def rollup(pid: int | str, field: str) -> int:
    """Bytes of `field` (Private_Dirty, Anonymous, Pss, ...) in /proc/PID/smaps_rollup."""
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def status(field: str) -> int:
    """Bytes of `field` (VmHWM, VmRSS, ...) in /proc/self/status."""
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def worker_memory(pids: list[int]) -> dict[int, tuple[int, int]]:
    """(Private_Dirty, USS) bytes of each process of `pids` still running."""
    import psutil

    out = {}
    for pid in pids:
        try:
            out[pid] = (rollup(pid, "Private_Dirty"), psutil.Process(pid).memory_full_info().uss)
        except (OSError, psutil.Error):
            continue
    return out


def cycled_reader(records: int):
    """A `FeatureReader` class whose store of `records` records `r0..` stands for every image: image k
    (the last 12 characters of its id, COCO's way) reads record `k % records`."""
    from storage import FeatureReader

    def stored(img_id: str) -> str:
        return f"r{int(img_id[-12:]) % records}"

    class CycledReader(FeatureReader):
        def __contains__(self, img_id: object) -> bool:
            return isinstance(img_id, str)

        def get(self, img_id, default=None):
            return super().get(stored(img_id), default)

        def read_batch(self, img_ids, width=None, alloc=np.empty):
            batch = super().read_batch([stored(i) for i in img_ids], width, alloc)
            batch.img_ids = list(img_ids)
            return batch

    return CycledReader


def drive_loader(
    dataset, collate, batch_size: int, batches: int, workers: int, start: float, every: int
) -> dict:
    """`batches` batches of `dataset` through the trainer's `BatchDataset` in a torch DataLoader of
    `workers` processes, as the trainer makes it; memory probed every `every` batches. `first_batch_s`
    counts from `start` (`time.perf_counter()` when the training process began its work)."""
    import psutil
    import torch

    from pipelines.engine.trainer import BatchDataset
    from pipelines.engine.worker_errors import Carrying

    rng = np.random.default_rng(0)
    epochs = -(-batches * batch_size // len(dataset))
    order = np.concatenate([rng.permutation(len(dataset)) for _ in range(epochs)])
    data = BatchDataset(dataset, collate, order, batch_size, (0, 0, 0))
    loader = torch.utils.data.DataLoader(
        Carrying(data),
        batch_size=None,
        sampler=range(batches),
        num_workers=workers,
        persistent_workers=False,
        prefetch_factor=4 if workers > 0 else None,
    )
    it = iter(loader)
    next(it)
    first = time.perf_counter() - start
    pids = [p.pid for p in psutil.Process().children()]
    base = worker_memory(pids)
    peak = dict(base)
    anon = rollup("self", "Anonymous")
    tick, done = time.perf_counter(), 1
    for done, _ in enumerate(it, 2):  # noqa: B007
        if done % every == 0 or done == batches - 1:
            anon = max(anon, rollup("self", "Anonymous"))
            for pid, mem in worker_memory(pids).items():
                peak[pid] = tuple(max(a, b) for a, b in zip(peak.get(pid, mem), mem, strict=True))
    elapsed = time.perf_counter() - tick
    growth = [tuple(p - b for p, b in zip(peak[pid], base[pid], strict=True)) for pid in base]
    return {
        "first_batch_s": first,
        "sps": (done - 1) * batch_size / elapsed if done > 1 else 0.0,
        "peak_anon_gb": anon / 2**30,
        "worker_growth_gb": max((g[0] for g in growth), default=0) / 2**30,
        "worker_uss_growth_gb": max((g[1] for g in growth), default=0) / 2**30,
    }
