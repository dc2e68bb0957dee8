"""NLVR2 data: statement rows about image pairs, a dataset over the feature store, pair collation."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch.utils.data import Dataset

from pipelines.data.column_tokens import row_tokens
from pipelines.data.columns import TEXT, RowColumns, Table
from pipelines.data.example_batch import ExampleBatch, as_batch
from pipelines.data.json_rows import field, read_rows


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
    return [NLVR2Example(**r) for r in _nlvr2_records(paths)]


def load_nlvr2_rows(
    paths: str | Path | Iterable[str | Path], cache_dir: str | Path | None = None
) -> NLVR2Rows:
    """The statements `load_nlvr2_examples` reads, as columns: converted once into `cache_dir` (keyed by
    the files) and mapped from there; in memory without one."""
    paths = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    if not all(p.is_file() for p in paths):  # a folder, or a missing file refused while reading
        cache_dir = None
    return NLVR2Rows.load(lambda: map(_nlvr2_columns, _nlvr2_records(paths)), paths, cache_dir)


def _nlvr2_records(paths: str | Path | Iterable[str | Path]) -> Iterator[dict]:
    seen: dict[str, Path] = {}
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        path = Path(path)
        for i, row in enumerate(read_rows(path)):
            ident = field(row, "identifier", str, path, i)
            if ident in seen:
                raise ValueError(f"{path}: row {i} repeats identifier {ident!r} (first in {seen[ident]})")
            seen[ident] = path
            yield {
                "identifier": ident,
                "img0": field(row, "img0", str, path, i),
                "img1": field(row, "img1", str, path, i),
                "sent": field(row, "sent", str, path, i),
                "label": _nlvr2_label(row.get("label"), path, i),
            }


def _nlvr2_columns(record: dict) -> dict:
    return {**record, "label": -1 if record["label"] is None else record["label"]}


class NLVR2Rows(RowColumns):
    """Statements as columns (see `RowColumns`); item i is statement i's `NLVR2Example`, built on demand."""

    SCHEMA: ClassVar[dict] = {
        "identifier": TEXT,
        "img0": Table("image"),
        "img1": Table("image"),
        "sent": TEXT,
        "label": np.int8,  # 0/1, -1: unknown
    }
    KIND = "nlvr2-rows"
    VERSION = 1
    IMAGES = ("img0", "img1")

    @classmethod
    def from_examples(cls, examples: Sequence[NLVR2Example]) -> NLVR2Rows:
        """Examples already in memory as in-memory columns."""
        fields = ("identifier", "img0", "img1", "sent", "label")
        return cls.build(_nlvr2_columns({f: getattr(e, f) for f in fields}) for e in examples)

    def keys(self, indices) -> list[str]:
        return self.texts("identifier", indices)

    def example(self, i: int) -> NLVR2Example:
        label = int(self.columns["label"][int(self.base(i))])
        img0, img1 = self.image_ids([i])
        return NLVR2Example(
            self.keys([i])[0], img0, img1, self.texts("sent", [i])[0], None if label < 0 else label
        )

    def unlabelled_keys(self) -> list[str]:
        return self.keys(np.nonzero(np.asarray(self.column("label")) < 0)[0])


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
        self.examples = examples if isinstance(examples, NLVR2Rows) else NLVR2Rows.from_examples(examples)
        self.features = features
        self.pad_id = tokenizer.pad_token_id
        self.texts = row_tokens(self.examples, "sent", tokenizer, max_length, cache_dir)
        self.labels = self.examples.column("label")

    def __len__(self) -> int:
        return len(self.examples)

    def request_ahead(self, indices) -> None:
        """Ask the store now for both images of statements `indices` (`FeatureReader.request_ahead`)."""
        self.features.request_ahead(self.examples.image_ids(np.asarray(indices, dtype=np.int64)))

    def __getitems__(self, indices) -> ExampleBatch:
        idx = np.asarray(indices, dtype=np.int64)
        labels = self.labels[idx].astype(np.int64)
        return ExampleBatch.read(
            self.features,
            ids=self.examples.keys(idx),
            images=self.examples.image_ids(idx),
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
