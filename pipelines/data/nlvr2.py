"""NLVR2 data: statement rows about image pairs, a dataset over the feature store, pair collation."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from pipelines.data.example_batch import ExampleBatch, as_batch
from pipelines.data.json_rows import field, read_rows
from pipelines.data.text import EncodedTexts


@dataclass(frozen=True)
class NLVR2Example:
    """One NLVR2 statement about an image pair; `label` is 1 when the statement is true, None if unknown."""

    identifier: str
    img0: str
    img1: str
    sent: str
    label: int | None = None

    @property
    def key(self) -> str:
        return self.identifier

    @property
    def images(self) -> tuple[str, ...]:
        return (self.img0, self.img1)


def _nlvr2_label(value, path: Path, index: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return int(value.lower() == "true")
    if isinstance(value, (bool, int)) and int(value) in (0, 1):
        return int(value)
    raise ValueError(f"{path}: row {index} label must be 0/1 (or 'True'/'False'), got {value!r}")


def load_nlvr2_examples(paths: str | Path | Iterable[str | Path]) -> list[NLVR2Example]:
    """NLVR2 rows `{identifier, img0, img1, sent, label?}` (label 0/1) from one or more files."""
    out: list[NLVR2Example] = []
    seen: dict[str, Path] = {}
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        path = Path(path)
        for i, row in enumerate(read_rows(path)):
            ident = field(row, "identifier", str, path, i)
            if ident in seen:
                raise ValueError(f"{path}: row {i} repeats identifier {ident!r} (first in {seen[ident]})")
            seen[ident] = path
            out.append(
                NLVR2Example(
                    identifier=ident,
                    img0=field(row, "img0", str, path, i),
                    img1=field(row, "img1", str, path, i),
                    sent=field(row, "sent", str, path, i),
                    label=_nlvr2_label(row.get("label"), path, i),
                )
            )
    return out


class NLVR2Dataset(Dataset):
    """NLVR2 statements read a micro-batch at a time (`__getitems__`): both images of every statement in
    one read transaction, statements tokenised once (`cache_dir`: kept there, pipelines.data.token_cache).
    Item i is the batch of statement i alone."""

    def __init__(
        self,
        examples: Sequence[NLVR2Example],
        features,
        tokenizer,
        max_length: int = 20,
        cache_dir: str | Path | None = None,
    ) -> None:
        self.examples = list(examples)
        self.features = features
        self.pad_id = tokenizer.pad_token_id
        self.texts = EncodedTexts(tokenizer, [e.sent for e in self.examples], max_length, cache_dir=cache_dir)
        self.labels = np.array([-1 if e.label is None else e.label for e in self.examples], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.examples)

    def request_ahead(self, indices) -> None:
        """Ask the store now for both images of statements `indices` (`FeatureReader.request_ahead`)."""
        self.features.request_ahead([img for i in indices for img in self.examples[i].images])

    def __getitems__(self, indices) -> ExampleBatch:
        idx = np.asarray(indices, dtype=np.int64)
        labels = self.labels[idx]
        rows = [self.examples[i] for i in idx.tolist()]  # Python ints: indexing by numpy scalars is slow
        return ExampleBatch.read(
            self.features,
            ids=[e.identifier for e in rows],
            images=[img for e in rows for img in e.images],
            texts=self.texts,
            rows=idx,
            pad_id=self.pad_id,
            labels=labels if (labels >= 0).all() else None,
        )

    def __getitem__(self, i: int) -> ExampleBatch:
        return self.__getitems__([i])


def collate_nlvr2(batch: ExampleBatch | list[ExampleBatch], pad_id: int = 0) -> dict:
    """Model inputs of NLVR2 statements: visual tensors are (B, 2, N, ...) with N the batch's largest
    region set (features as stored, widened on the device); labels (B,) when all are labelled."""
    batch = as_batch(batch, pad_id)
    out = batch.text_inputs()
    out.update({k: v.unflatten(0, (batch.size, 2)) for k, v in batch.regions.model_inputs().items()})
    out["ids"] = batch.ids
    if batch.labels is not None:
        out["labels"] = torch.from_numpy(batch.labels)
    return out
