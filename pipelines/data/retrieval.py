"""Caption-image retrieval data: captions with their image, training batches with in-batch negative
images, and the caption x image pairs an evaluation scores."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from pipelines.data.json_rows import field, read_json, read_rows
from pipelines.data.regions import pad_regions, region_arrays
from pipelines.data.text import EncodedTexts, pad_text

# Training: each caption against its own image and this many others of the batch (the release: 1 + 3).
CANDIDATES = 4


def pair_key(caption_id: str, img_id: str) -> str:
    """The prediction key of a caption-image pair (a string: batches carry ids through device moves)."""
    return f"{caption_id}\t{img_id}"


def split_pair_key(key: str) -> tuple[str, str]:
    caption_id, img_id = key.split("\t", 1)
    return caption_id, img_id


@dataclass(frozen=True)
class RetrievalExample:
    """One caption; `label` is the id of the image it describes (None when unknown)."""

    caption_id: str
    img_id: str
    sent: str
    label: str | None = None

    @property
    def key(self) -> str:
        return self.caption_id

    @property
    def images(self) -> tuple[str, ...]:
        return (self.img_id,)


def _karpathy(path: Path, data: dict, splits: set[str] | None) -> list[RetrievalExample]:
    """Karpathy's `dataset_coco.json` / `dataset_flickr30k.json`: the image id is the file name's stem."""
    out = []
    for i, image in enumerate(data["images"]):
        if splits is not None and image.get("split") not in splits:
            continue
        img_id = Path(field(image, "filename", str, path, i)).stem
        for j, sentence in enumerate(field(image, "sentences", list, path, i)):
            sent = sentence.get("raw") if isinstance(sentence, dict) else None
            if not isinstance(sent, str):
                raise ValueError(f"{path}: image {i} sentence {j} has no 'raw' text; fix the file")
            out.append(RetrievalExample(f"{img_id}#{sentence.get('sentid', j)}", img_id, sent, img_id))
    return out


def load_retrieval_examples(paths: str | Path | Iterable[str | Path]) -> list[RetrievalExample]:
    """Captions from row files `[{"img_id", "sentences": [str, ...]}]` (caption ids `img_id#k`), or from
    Karpathy's split file, where `FILE#test` (or `#train,restval`) keeps those splits only."""
    out: list[RetrievalExample] = []
    for spec in [paths] if isinstance(paths, (str, Path)) else paths:
        name, _, wanted = str(spec).partition("#")
        path = Path(name)
        splits = set(wanted.split(",")) if wanted else None
        data = read_json(path) if path.suffix == ".json" else None
        if isinstance(data, dict) and "images" in data:
            out.extend(_karpathy(path, data, splits))
            continue
        if splits is not None:
            raise ValueError(f"{spec}: a '#split' selector needs a Karpathy dataset_*.json file")
        for i, row in enumerate(data if isinstance(data, list) else read_rows(path)):
            img_id = field(row, "img_id", str, path, i)
            for k, sent in enumerate(field(row, "sentences", list, path, i)):
                if not isinstance(sent, str):
                    raise ValueError(f"{path}: row {i} sentence {k} is not a string; fix the row")
                out.append(RetrievalExample(f"{img_id}#{k}", img_id, sent, img_id))
    seen: set[str] = set()
    for ex in out:
        if ex.caption_id in seen:
            raise ValueError(f"caption id {ex.caption_id!r} appears twice in {paths}; give each split once")
        seen.add(ex.caption_id)
    return out


class CaptionDataset(Dataset):
    """Training items: a caption with the regions of its image."""

    def __init__(
        self, examples: Sequence[RetrievalExample], features, tokenizer, max_length: int = 20
    ) -> None:
        self.examples = list(examples)
        self.features = features
        self.texts = EncodedTexts(tokenizer, [e.sent for e in self.examples], max_length)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict:
        ex = self.examples[i]
        feats, boxes = region_arrays(self.features[ex.img_id])
        return {
            "id": ex.caption_id,
            "img_id": ex.img_id,
            "input_ids": self.texts[i],
            "feats": feats,
            "boxes": boxes,
        }


class PairDataset(Dataset):
    """Evaluation items: every caption with every image of the split (captions x images pairs), labelled
    1 where the image is the caption's own when the captions are labelled."""

    def __init__(
        self, examples: Sequence[RetrievalExample], features, tokenizer, max_length: int = 20
    ) -> None:
        self.examples = list(examples)
        self.features = features
        self.gallery = list(dict.fromkeys(e.img_id for e in self.examples))
        self.texts = EncodedTexts(tokenizer, [e.sent for e in self.examples], max_length)

    def __len__(self) -> int:
        return len(self.examples) * len(self.gallery)

    def __getitem__(self, i: int) -> dict:
        caption, image = divmod(i, len(self.gallery))
        ex, img_id = self.examples[caption], self.gallery[image]
        feats, boxes = region_arrays(self.features[img_id])
        item = {
            "id": pair_key(ex.caption_id, img_id),
            "input_ids": self.texts[caption],
            "feats": feats,
            "boxes": boxes,
        }
        if ex.label is not None:
            item["label"] = int(ex.label == img_id)
        return item


def collate_pairs(items: list[dict], pad_id: int = 0) -> dict:
    """Caption-image pairs: visual tensors (B, N, ...), labels (B,) 1 = the caption's own image."""
    batch = pad_text([it["input_ids"] for it in items], pad_id)
    batch.update(pad_regions([it["feats"] for it in items], [it["boxes"] for it in items]).model_inputs())
    batch["ids"] = [it["id"] for it in items]
    if all("label" in it for it in items):
        batch["labels"] = torch.tensor([it["label"] for it in items], dtype=torch.long)
    return batch


def collate_candidates(
    items: list[dict], pad_id: int, rng: np.random.Generator, candidates: int = CANDIDATES
) -> dict:
    """Each caption against its own image and up to `candidates - 1` other images of the batch, at a
    random place among them: visual tensors (B, K, N, ...), labels (B,) the own image's index."""
    owners: dict[str, int] = {}
    for i, it in enumerate(items):
        owners.setdefault(it["img_id"], i)
    k = min(candidates, len(owners))
    if k < 2:
        raise ValueError("a retrieval batch needs captions of at least two images; raise the batch size")
    feats, boxes, labels = [], [], []
    for it in items:
        others = [owners[img] for img in owners if img != it["img_id"]]
        chosen = [owners[it["img_id"]], *rng.choice(others, size=k - 1, replace=False).tolist()]
        order = rng.permutation(k)
        labels.append(int(np.flatnonzero(order == 0)[0]))
        feats += [items[chosen[j]]["feats"] for j in order]
        boxes += [items[chosen[j]]["boxes"] for j in order]
    batch = pad_text([it["input_ids"] for it in items], pad_id)
    regions = pad_regions(feats, boxes).model_inputs()
    batch.update({name: v.unflatten(0, (len(items), k)) for name, v in regions.items()})
    batch["ids"] = [it["id"] for it in items]
    batch["labels"] = torch.tensor(labels, dtype=torch.long)
    return batch
