"""Errors met in DataLoader and Ray Train workers come back as the one line they are in one process."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader, Dataset

from pipelines.engine.worker_errors import Carrying, carrying_collate, original_error, raising


class Damaged(Dataset):
    """Item 3 is a damaged record."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> dict:
        if i == 3:
            raise ValueError("record 'img3' of store s.lmdb is damaged; run xmodal features verify s.lmdb")
        return {"i": i}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_worker_error_arrives_as_itself(workers):
    loader = DataLoader(Carrying(Damaged()), batch_size=None, num_workers=workers)
    seen = []
    with pytest.raises(ValueError) as info:
        for batch in raising(loader):
            seen.append(batch["i"])
    assert str(info.value) == "record 'img3' of store s.lmdb is damaged; run xmodal features verify s.lmdb"
    assert seen == [0, 1, 2]


def test_a_batched_loader_passes_the_error_over_collation():
    loader = DataLoader(
        Carrying(Damaged()), batch_size=2, num_workers=2, collate_fn=carrying_collate(lambda items: items)
    )
    with pytest.raises(ValueError, match=r"^record 'img3' .*features verify s.lmdb$"):
        list(raising(loader))


def test_torch_wrapped_loader_error_is_unwrapped():
    """Without `Carrying`, torch re-raises the worker's error with its traceback in the message."""
    loader = DataLoader(Damaged(), batch_size=None, num_workers=1)
    with pytest.raises(ValueError) as info:
        list(loader)
    assert "Traceback" in str(info.value)  # what torch does, and why the loop carries errors itself
    unwrapped = original_error(info.value)
    assert type(unwrapped) is ValueError
    assert str(unwrapped) == "record 'img3' of store s.lmdb is damaged; run xmodal features verify s.lmdb"


class _Failure:
    def __init__(self, cause: BaseException):
        self.cause = cause


class _TrainingFailed(Exception):
    """The shape of Ray Train's TrainingFailedError: worker rank -> failure with a `cause`."""

    def __init__(self, failures: dict):
        super().__init__("Training failed due to worker errors:\nTraceback (most recent call last): ...")
        self.worker_failures = failures


def test_a_ray_train_failure_is_its_workers_error():
    nan = FloatingPointError("loss is nan at step 3 (mlm=nan); no checkpoint was written; lower train.lr")
    failed = _TrainingFailed({1: _Failure(nan), 0: _Failure(RuntimeError("collective aborted"))})
    assert original_error(failed) is nan
    # a worker error that is not bad input stays as Ray raised it
    other = _TrainingFailed({0: _Failure(RuntimeError("NCCL timeout"))})
    assert original_error(other) is other


def test_a_ray_task_error_is_its_cause():
    cause = KeyError("answers")
    wrapped = RuntimeError("ray::train_fn() (pid=1)\nTraceback ...")
    wrapped.cause = cause  # what RayTaskError carries
    assert original_error(wrapped) is cause
