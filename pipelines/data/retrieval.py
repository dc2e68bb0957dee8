"""Caption-image retrieval data: captions with their image, training batches with in-batch negative
images, and the caption x image pairs an evaluation scores."""

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
from pipelines.data.json_rows import field, read_json, read_rows
from pipelines.data.regions import IMAGE_SIZE

VISUAL_INPUTS = ("visual_feats", "visual_pos", "visual_attention_mask", IMAGE_SIZE)
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


def load_retrieval_rows(
    paths: str | Path | Iterable[str | Path], cache_dir: str | Path | None = None
) -> RetrievalRows:
    """The captions `load_retrieval_examples` reads, as columns: converted once into `cache_dir` (keyed by
    the files and their split selectors) and mapped from there; in memory without one."""
    specs = [paths] if isinstance(paths, (str, Path)) else list(paths)
    files = [Path(str(spec).partition("#")[0]) for spec in specs]
    if not all(p.is_file() for p in files):  # a folder, or a missing file refused while reading
        cache_dir = None

    def records() -> Iterator[dict]:
        return map(_retrieval_columns, load_retrieval_examples(specs))

    return RetrievalRows.load(records, files, cache_dir, [str(s) for s in specs])


def _retrieval_columns(e: RetrievalExample) -> dict:
    return {"caption_id": e.caption_id, "image": e.img_id, "sent": e.sent, "label": e.label}


class RetrievalRows(RowColumns):
    """Captions as columns (see `RowColumns`); item i is caption i's `RetrievalExample`, built on demand.
    A caption's label (the image it describes) indexes the same image table as its image."""

    SCHEMA: ClassVar[dict] = {
        "caption_id": TEXT,
        "image": Table("image"),
        "sent": TEXT,
        "label": Table("image"),  # -1: unknown
    }
    KIND = "retrieval-rows"
    VERSION = 1
    IMAGES = ("image",)

    @classmethod
    def from_examples(cls, examples: Sequence[RetrievalExample]) -> RetrievalRows:
        return cls.build(map(_retrieval_columns, examples))

    def keys(self, indices) -> list[str]:
        return self.texts("caption_id", indices)

    def example(self, i: int) -> RetrievalExample:
        caption_id, sent = self.keys([i])[0], self.texts("sent", [i])[0]
        return RetrievalExample(caption_id, self.image_ids([i])[0], sent, self.values("label", [i])[0])

    def unlabelled_keys(self) -> list[str]:
        return self.keys(np.nonzero(np.asarray(self.column("label")) < 0)[0])


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
    """Training captions read a micro-batch at a time (`__getitems__`): their images' regions in one
    read transaction, captions tokenised once (`cache_dir`: kept there). Item i: caption i alone."""

    def __init__(
        self,
        examples: Sequence[RetrievalExample],
        features,
        tokenizer,
        max_length: int = 20,
        cache_dir: str | Path | None = None,
    ) -> None:
        self.examples = _rows(examples)
        self.features = features
        self.pad_id = tokenizer.pad_token_id
        self.texts = row_tokens(self.examples, "sent", tokenizer, max_length, cache_dir)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitems__(self, indices) -> ExampleBatch:
        idx = np.asarray(indices, dtype=np.int64)
        return ExampleBatch.read(
            self.features,
            ids=self.examples.keys(idx),
            images=self.examples.image_ids(idx),
            texts=self.texts,
            rows=idx,
            pad_id=self.pad_id,
        )

    def __getitem__(self, i: int) -> ExampleBatch:
        return self.__getitems__([i])


class PairDataset(Dataset):
    """Evaluation pairs: every caption with every image of the split (captions x images, item
    `caption * images + image`), labelled 1 where the image is the caption's own when the captions are
    labelled; read a micro-batch at a time like `CaptionDataset`."""

    def __init__(
        self,
        examples: Sequence[RetrievalExample],
        features,
        tokenizer,
        max_length: int = 20,
        cache_dir: str | Path | None = None,
    ) -> None:
        self.examples = _rows(examples)
        self.features = features
        self.pad_id = tokenizer.pad_token_id
        self.gallery = self.examples.used_images()
        index = {name: i for i, name in enumerate(self.examples.image_names)}
        self.gallery_index = np.array([index[name] for name in self.gallery], dtype=np.int64)
        self.label_index = self.examples.column("label")
        self.texts = row_tokens(self.examples, "sent", tokenizer, max_length, cache_dir)

    def __len__(self) -> int:
        return len(self.examples) * len(self.gallery)

    def __getitems__(self, indices) -> ExampleBatch:
        captions, images = np.divmod(np.asarray(indices, dtype=np.int64), len(self.gallery))
        gallery = [self.gallery[i] for i in images.tolist()]
        own = self.label_index[captions]
        keys = self.examples.keys(captions)
        return ExampleBatch.read(
            self.features,
            ids=[pair_key(c, img) for c, img in zip(keys, gallery, strict=True)],
            images=gallery,
            texts=self.texts,
            rows=captions,
            pad_id=self.pad_id,
            labels=(own == self.gallery_index[images]).astype(np.int64) if (own >= 0).all() else None,
        )

    def __getitem__(self, i: int) -> ExampleBatch:
        return self.__getitems__([i])


def _rows(examples: Sequence[RetrievalExample]) -> RetrievalRows:
    return examples if isinstance(examples, RetrievalRows) else RetrievalRows.from_examples(examples)


def collate_pairs(batch: ExampleBatch | list[ExampleBatch], pad_id: int = 0) -> dict:
    """Caption-image pairs: visual tensors (B, N, ...) (features as stored, widened on the device),
    labels (B,) 1 = the caption's own image."""
    batch = as_batch(batch, pad_id)
    out = {**batch.text_inputs(), **batch.regions.model_inputs(), "ids": batch.ids}
    if batch.labels is not None:
        out["labels"] = torch.from_numpy(batch.labels)
    return out


def collate_candidates(
    batch: ExampleBatch | list[ExampleBatch],
    pad_id: int,
    rng: np.random.Generator,
    candidates: int = CANDIDATES,
) -> dict:
    """Each caption against its own image and up to `candidates - 1` other images of the batch, at a
    random place among them: `candidates` (B, K) rows of the batch's visual tensors (B, N, ...; N its
    largest region set) to show, gathered by `candidate_inputs`; labels (B,) the own image's index."""
    batch = as_batch(batch, pad_id)
    owners: dict[str, int] = {}
    for i, img in enumerate(batch.images):
        owners.setdefault(img, i)
    k = min(candidates, len(owners))
    if k < 2:
        raise ValueError("a retrieval batch needs captions of at least two images; raise the batch size")
    rows = np.empty((batch.size, k), dtype=np.int64)
    labels = np.empty(batch.size, dtype=np.int64)
    for i, img in enumerate(batch.images):
        others = [owners[other] for other in owners if other != img]
        chosen = np.array([owners[img], *rng.choice(others, size=k - 1, replace=False).tolist()])
        order = rng.permutation(k)
        labels[i] = int(np.flatnonzero(order == 0)[0])
        rows[i] = chosen[order]
    # the batch's own rows travel once; `candidate_inputs` gathers the K per caption on the device
    out = {**batch.text_inputs(), **batch.regions.model_inputs()}
    out["candidates"] = torch.from_numpy(rows)
    out["ids"] = batch.ids
    out["labels"] = torch.from_numpy(labels)
    return out


def candidate_inputs(batch: dict) -> dict:
    """A `collate_candidates` batch with its visual tensors gathered per caption: (B, K, N, ...)."""
    rows = batch["candidates"]
    return {**batch, **{name: batch[name][rows] for name in VISUAL_INPUTS if name in batch}}
