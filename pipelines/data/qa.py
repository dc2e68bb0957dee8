"""VQA/GQA data: the community JSON rows, a dataset over the feature store, collation with soft targets."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from pipelines.data.answers import AnswerTable
from pipelines.data.json_rows import field, read_rows
from pipelines.data.regions import pad_regions, region_arrays
from pipelines.data.text import EncodedTexts, pad_text


@dataclass(frozen=True)
class QAExample:
    """One VQA or GQA question; `label` maps answers to soft scores and is None in unlabelled splits."""

    question_id: int | str
    img_id: str
    sent: str
    label: dict[str, float] | None = None
    answer_type: str | None = None
    question_type: str | None = None

    @property
    def key(self) -> int | str:
        return self.question_id

    @property
    def images(self) -> tuple[str, ...]:
        return (self.img_id,)


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
            qid = field(row, "question_id", (int, str), path, i)
            if qid in seen:
                raise ValueError(f"{path}: row {i} repeats question_id {qid!r} (first in {seen[qid]})")
            seen[qid] = path
            out.append(
                QAExample(
                    question_id=qid,
                    img_id=field(row, "img_id", str, path, i),
                    sent=field(row, "sent", str, path, i),
                    label=_qa_label(row, path, i),
                    answer_type=row.get("answer_type"),
                    question_type=row.get("question_type"),
                )
            )
    return out


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
        feats, boxes = region_arrays(self.features[ex.img_id])
        item = {
            "id": ex.question_id,
            "input_ids": self.texts[i],
            "feats": feats,
            "boxes": boxes,
        }
        if ex.label is not None:
            item["target"] = soft_target(ex.label, self.answers)
        return item


def collate_qa(items: list[dict], pad_id: int = 0) -> dict:
    """Stack QA items: padded text, regions padded to the batch's largest set, soft targets if labelled."""
    batch = pad_text([it["input_ids"] for it in items], pad_id)
    batch.update(pad_regions([it["feats"] for it in items], [it["boxes"] for it in items]).model_inputs())
    batch["ids"] = [it["id"] for it in items]
    if all("target" in it for it in items):
        batch["labels"] = torch.from_numpy(np.stack([it["target"] for it in items]))
    return batch
