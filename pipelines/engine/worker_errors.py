"""Bad input met in another process comes back as itself: a DataLoader worker's error is carried to the
loop as the exception it was (torch would re-raise it wrapped in the worker's traceback), and a Ray Train
worker's error as the one line the command prints in a single process."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import Dataset, get_worker_info

# what the commands print as one line: bad input, a missing or unreadable file, a run that went non-finite
USER_ERRORS = (ValueError, KeyError, OSError, FloatingPointError)


@dataclass
class Carried:
    """A user error raised in a DataLoader worker, travelling to the loop in place of a batch."""

    error: BaseException


class Carrying(Dataset):
    """`dataset`, whose user errors in a DataLoader worker come back as `Carried` items."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except USER_ERRORS as exc:
            if get_worker_info() is None:  # in the loop's own process it is raised there already
                raise
            return Carried(exc.with_traceback(None))


def carrying_collate(collate: Callable[[list], Any]) -> Callable[[list], Any]:
    """`collate` that passes a `Carried` item on instead of collating the batch around it."""

    def collate_items(items: list) -> Any:
        for item in items:
            if isinstance(item, Carried):
                return item
        return collate(items)

    return collate_items


def raising(batches: Iterable) -> Iterator:
    """`batches`, raising a carried error as itself where it arrives."""
    for batch in batches:
        if isinstance(batch, Carried):
            raise batch.error
        yield batch


def original_error(exc: BaseException) -> BaseException:
    """The user error inside `exc` as the command met it: a Ray Train failure's worker error, a Ray task
    error's cause, or a DataLoader worker's error (whose last traceback line is the original message);
    anything else as it is."""
    failures = getattr(exc, "worker_failures", None) or {}
    for _, failure in sorted(failures.items()):
        cause = original_error(getattr(failure, "cause", None) or failure)
        if isinstance(cause, USER_ERRORS):
            return cause
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and cause is not exc:
        return original_error(cause)
    text = str(exc)
    if isinstance(exc, USER_ERRORS) and "\nOriginal Traceback" in text:
        last = [line for line in text.splitlines() if line.strip()][-1]
        return type(exc)(last.split(": ", 1)[-1]) if ": " in last else exc
    return exc
