"""NLVR2 data: statement rows about image pairs, a dataset over the feature store, pair collation."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

from pipelines.data.json_rows import field, read_rows
from pipelines.data.regions import pad_regions, region_arrays
from pipelines.data.text import EncodedTexts, pad_text


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
    """NLVR2 statements with the regions of both images and (when labelled) the 0/1 label."""

    def __init__(self, examples: Sequence[NLVR2Example], features, tokenizer, max_length: int = 20) -> None:
        self.examples = list(examples)
        self.features = features
        self.texts = EncodedTexts(tokenizer, [e.sent for e in self.examples], max_length)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict:
        ex = self.examples[i]
        regions = [region_arrays(self.features[img]) for img in ex.images]
        item = {
            "id": ex.identifier,
            "input_ids": self.texts[i],
            "feats": [f for f, _ in regions],
            "boxes": [b for _, b in regions],
        }
        if ex.label is not None:
            item["label"] = ex.label
        return item


def collate_nlvr2(items: list[dict], pad_id: int = 0) -> dict:
    """Stack NLVR2 items: visual tensors are (B, 2, N, ...) with N the batch's largest region set."""
    batch = pad_text([it["input_ids"] for it in items], pad_id)
    regions = pad_regions([f for it in items for f in it["feats"]], [b for it in items for b in it["boxes"]])
    batch.update({k: v.unflatten(0, (len(items), 2)) for k, v in regions.model_inputs().items()})
    batch["ids"] = [it["id"] for it in items]
    if all("label" in it for it in items):
        batch["labels"] = torch.tensor([it["label"] for it in items], dtype=torch.long)
    return batch
