"""Fine-tuning data: the community VQA/GQA/NLVR2 JSON files, datasets over the feature store, collation."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from pipelines.answers import AnswerTable
from storage import RegionFeatures


@dataclass(frozen=True)
class QAExample:
    """One VQA or GQA question; `label` maps answers to soft scores and is None in unlabelled splits."""

    question_id: int | str
    img_id: str
    sent: str
    label: dict[str, float] | None = None
    answer_type: str | None = None
    question_type: str | None = None


@dataclass(frozen=True)
class NLVR2Example:
    """One NLVR2 statement about an image pair; `label` is 1 when the statement is true, None if unknown."""

    identifier: str
    img0: str
    img1: str
    sent: str
    label: int | None = None


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a JSON list file, or of a JSON-lines file (the official NLVR2 release)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}; check the path") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as first:
        data = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                data.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}: neither a JSON list ({first.msg} at line {first.lineno}) nor JSON lines "
                    f"(line {n}: {e.msg}); fix the file"
                ) from e
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{path}: expected a JSON list of objects (or one object per line)")
    return data


def _field(row: dict, name: str, kind: type | tuple[type, ...], path: Path, index: int):
    if name not in row:
        raise ValueError(f"{path}: row {index} has no {name!r} field (keys: {sorted(row)}); fix or remove it")
    value = row[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{path}: row {index} field {name!r} has type {type(value).__name__}; fix the row")
    return value


def _qa_label(row: dict, path: Path, index: int) -> dict[str, float] | None:
    label = row.get("label")
    if label is None:
        return None
    numeric = (int, float)
    if not isinstance(label, dict) or not all(
        isinstance(k, str) and isinstance(v, numeric) and not isinstance(v, bool) for k, v in label.items()
    ):
        raise ValueError(f"{path}: row {index} label must map answers to scores, got {label!r}")
    return {k: float(v) for k, v in label.items()}


def load_qa_examples(paths: str | Path | Iterable[str | Path]) -> list[QAExample]:
    """VQA/GQA rows `{question_id, img_id, sent, label?, answer_type?, question_type?}` from files."""
    out: list[QAExample] = []
    seen: dict[int | str, Path] = {}
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        path = Path(path)
        for i, row in enumerate(read_rows(path)):
            qid = _field(row, "question_id", (int, str), path, i)
            if qid in seen:
                raise ValueError(f"{path}: row {i} repeats question_id {qid!r} (first in {seen[qid]})")
            seen[qid] = path
            out.append(
                QAExample(
                    question_id=qid,
                    img_id=_field(row, "img_id", str, path, i),
                    sent=_field(row, "sent", str, path, i),
                    label=_qa_label(row, path, i),
                    answer_type=row.get("answer_type"),
                    question_type=row.get("question_type"),
                )
            )
    return out


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
            ident = _field(row, "identifier", str, path, i)
            if ident in seen:
                raise ValueError(f"{path}: row {i} repeats identifier {ident!r} (first in {seen[ident]})")
            seen[ident] = path
            out.append(
                NLVR2Example(
                    identifier=ident,
                    img0=_field(row, "img0", str, path, i),
                    img1=_field(row, "img1", str, path, i),
                    sent=_field(row, "sent", str, path, i),
                    label=_nlvr2_label(row.get("label"), path, i),
                )
            )
    return out


def image_ids(examples: Sequence[QAExample | NLVR2Example]) -> list[str]:
    """Every image id the examples refer to, in first-use order."""
    ids: dict[str, None] = {}
    for ex in examples:
        for img in (ex.img0, ex.img1) if isinstance(ex, NLVR2Example) else (ex.img_id,):
            ids.setdefault(img, None)
    return list(ids)


def check_images(examples: Sequence[QAExample | NLVR2Example], features, what: str) -> None:
    """Fail with a count and examples when images are missing from the feature store."""
    missing = [img for img in image_ids(examples) if img not in features]
    if missing:
        raise ValueError(
            f"{what}: {len(missing)} image ids are not in the feature store (e.g. {missing[:5]}); "
            "extract them or pass the store that holds them"
        )


def normalized_boxes(rec: RegionFeatures) -> np.ndarray:
    """Boxes as (x1/W, y1/H, x2/W, y2/H), clipped to [0, 1] like LXMERT's loaders expect."""
    scale = np.array([rec.img_w, rec.img_h, rec.img_w, rec.img_h], dtype=np.float32)
    return np.clip(rec.boxes.astype(np.float32) / scale, 0.0, 1.0)


def encode_text(tokenizer, sent: str, max_length: int) -> np.ndarray:
    """`[CLS] tokens [SEP]` ids, truncated to `max_length`."""
    return np.asarray(tokenizer(sent, truncation=True, max_length=max_length)["input_ids"], dtype=np.int64)


class EncodedTexts:
    """All sentences tokenized once up front, kept as one flat array plus offsets: no per-item tokenizer
    calls, and no per-sentence Python objects for forked DataLoader workers to copy on access."""

    def __init__(self, tokenizer, sents: Sequence[str], max_length: int, chunk: int = 65536) -> None:
        pieces: list[np.ndarray] = []
        for start in range(0, len(sents), chunk):
            encoded = tokenizer(list(sents[start : start + chunk]), truncation=True, max_length=max_length)
            pieces.extend(np.asarray(ids, dtype=np.int32) for ids in encoded["input_ids"])
        lengths = np.array([len(p) for p in pieces], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        self.ids = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.ids[self.offsets[i] : self.offsets[i + 1]].astype(np.int64)


def soft_target(label: Mapping[str, float] | None, answers: AnswerTable) -> np.ndarray:
    """Soft-score vector over the answer table; answers outside the table are dropped (as in LXMERT)."""
    target = np.zeros(len(answers), dtype=np.float32)
    for idx, score in answers.labels(label or {}).items():
        target[idx] = score
    return target


class QADataset(Dataset):
    """VQA/GQA questions with their image's regions and (when labelled) soft-score targets."""

    def __init__(
        self,
        examples: Sequence[QAExample],
        features,
        tokenizer,
        answers: AnswerTable,
        max_length: int = 20,
    ) -> None:
        self.examples = list(examples)
        self.features = features
        self.texts = EncodedTexts(tokenizer, [e.sent for e in self.examples], max_length)
        self.answers = answers

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict:
        ex = self.examples[i]
        rec = self.features[ex.img_id]
        item = {
            "id": ex.question_id,
            "input_ids": self.texts[i],
            "feats": np.asarray(rec.features, dtype=np.float32),
            "boxes": normalized_boxes(rec),
        }
        if ex.label is not None:
            item["target"] = soft_target(ex.label, self.answers)
        return item


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
        recs = [self.features[ex.img0], self.features[ex.img1]]
        item = {
            "id": ex.identifier,
            "input_ids": self.texts[i],
            "feats": [np.asarray(r.features, dtype=np.float32) for r in recs],
            "boxes": [normalized_boxes(r) for r in recs],
        }
        if ex.label is not None:
            item["label"] = ex.label
        return item


def _pad_text(seqs: list[np.ndarray], pad_id: int) -> dict[str, torch.Tensor]:
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.from_numpy(s)
        mask[i, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}


def _pad_regions(feats: list[np.ndarray], boxes: list[np.ndarray], num: int):
    """Zero-pad region sets to `num` slots; the mask marks real regions."""
    dim = feats[0].shape[1]
    out_f = torch.zeros((len(feats), num, dim), dtype=torch.float32)
    out_b = torch.zeros((len(feats), num, 4), dtype=torch.float32)
    mask = torch.zeros((len(feats), num), dtype=torch.float32)
    for i, (f, b) in enumerate(zip(feats, boxes, strict=True)):
        n = f.shape[0]
        out_f[i, :n] = torch.from_numpy(f)
        out_b[i, :n] = torch.from_numpy(b)
        mask[i, :n] = 1.0
    return out_f, out_b, mask


def collate_qa(items: list[dict], pad_id: int = 0) -> dict:
    """Stack QA items: padded text, regions padded to the batch's largest set, soft targets if labelled."""
    batch = _pad_text([it["input_ids"] for it in items], pad_id)
    num = max(it["feats"].shape[0] for it in items)
    feats, boxes, mask = _pad_regions([it["feats"] for it in items], [it["boxes"] for it in items], num)
    batch.update(visual_feats=feats, visual_pos=boxes, visual_attention_mask=mask)
    batch["ids"] = [it["id"] for it in items]
    if all("target" in it for it in items):
        batch["labels"] = torch.from_numpy(np.stack([it["target"] for it in items]))
    return batch


def collate_nlvr2(items: list[dict], pad_id: int = 0) -> dict:
    """Stack NLVR2 items: visual tensors are (B, 2, N, ...) with N the batch's largest region set."""
    batch = _pad_text([it["input_ids"] for it in items], pad_id)
    num = max(f.shape[0] for it in items for f in it["feats"])
    feats, boxes, mask = _pad_regions(
        [f for it in items for f in it["feats"]], [b for it in items for b in it["boxes"]], num
    )
    b = len(items)
    batch.update(
        visual_feats=feats.view(b, 2, num, -1),
        visual_pos=boxes.view(b, 2, num, 4),
        visual_attention_mask=mask.view(b, 2, num),
    )
    batch["ids"] = [it["id"] for it in items]
    if all("label" in it for it in items):
        batch["labels"] = torch.tensor([it["label"] for it in items], dtype=torch.long)
    return batch
