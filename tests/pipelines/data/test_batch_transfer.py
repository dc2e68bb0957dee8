"""Batches crossing from a DataLoader worker: the same tensors arrive (values, dtypes, shapes), a batch the
training process still holds is never overwritten by a later one, and a worker's buffers are reused once
the training process lets go of them."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from pipelines.data.batch_transfer import INLINE_BYTES, WorkerBatch, for_transfer
from pipelines.data.shared_memory import batch_allocator, worker_pool

BIG = (INLINE_BYTES // 2 // 1000 + 1, 1000)  # float16: just over the inline limit


def expected(i: int) -> dict:
    """Batch i as plain tensors, built here without any pooling."""
    rng = np.random.default_rng(i)
    feats = rng.standard_normal(BIG).astype(np.float16)
    return {
        "feats": torch.from_numpy(feats),
        "targets": torch.full((300, 1000), float(i), dtype=torch.float32),  # big, built outside the pool
        "ids": torch.arange(i, i + 7, dtype=torch.int64).reshape(1, 7),
        "mask": torch.from_numpy(rng.random((5, 3)) < 0.5),
        "half": torch.from_numpy(rng.random(4).astype(np.float16)),
        "scalar": torch.tensor(i * 1.5),
        "empty": torch.zeros((0, 4), dtype=torch.int32),
        "strided": torch.arange(12.0).reshape(3, 4).t() + i,
        "names": [f"img{i}", "x"],
        "epoch": i,
    }


class Batches(Dataset):
    """Item i: `expected(i)` with its features written into the worker's batch memory, and how many
    buffers the worker's pool holds when it is built."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int):
        out = expected(i)
        feats = batch_allocator()(BIG, np.dtype(np.float16))
        feats[...] = out["feats"].numpy()
        out["feats"] = torch.from_numpy(feats)
        out["feats_again"] = out["feats"]  # one buffer under two names
        out["buffers"] = len(worker_pool().buffers)
        return for_transfer(out)


def _check(got: dict, i: int) -> None:
    want = expected(i)
    assert type(got) is dict and list(got) == [*want, "feats_again", "buffers"]
    assert torch.equal(got["feats_again"], want["feats"])
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def test_held_batches_arrive_whole_and_stay_intact():
    loader = DataLoader(Batches(), batch_size=None, num_workers=1, prefetch_factor=2)
    held = list(loader)  # every batch kept: no buffer may be handed out twice
    for i, got in enumerate(held):
        _check(got, i)
    assert held[-1]["buffers"] >= 3 * (len(held) - 1)  # three shared tensors per batch, none reused


def test_buffers_are_reused_once_released():
    loader = DataLoader(Batches(), batch_size=None, num_workers=1, prefetch_factor=2)
    sizes = []
    for i, got in enumerate(loader):
        _check(got, i)
        sizes.append(got["buffers"])
        del got  # released: the worker may fill its buffers again
    # at most the batches in flight (queue, the one held here, the one being built) hold buffers
    assert max(sizes) <= 12, sizes


def test_in_the_training_process_a_batch_stays_a_dict():
    batch = Batches()[3]
    assert isinstance(batch, WorkerBatch)
    _check(dict(batch), 3)
    assert for_transfer([1, 2]) == [1, 2]  # not a dict: left alone


def test_a_buffer_under_two_names_outlives_either():
    loader = DataLoader(Batches(), batch_size=None, num_workers=1, prefetch_factor=2)
    kept = []
    for got in loader:
        kept.append(got["feats_again"])  # the batch and its "feats" are freed at once
        del got
    for i, feats in enumerate(kept):
        assert torch.equal(feats, expected(i)["feats"]), i
