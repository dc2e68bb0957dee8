"""VQA/GQA data: the community JSON rows, a dataset read by micro-batch, collation with soft targets."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from pipelines.data.answers import AnswerTable
from pipelines.data.json_rows import field, read_rows
from pipelines.data.regions import PaddedRegions, read_regions
from pipelines.data.text import EncodedTexts


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


@dataclass
class QABatch:
    """Questions `ids` column by column: token ids (B, L) right-padded, their lengths, their images'
    regions (features in the store's dtype) and soft targets (B, answers), None unless all are labelled."""

    ids: list
    token_ids: np.ndarray
    lengths: np.ndarray
    regions: PaddedRegions
    targets: np.ndarray | None

    @staticmethod
    def concat(batches: list[QABatch], pad_id: int) -> QABatch:
        """Several batches (e.g. single questions) as one, text and regions padded to the widest."""
        length = max(b.token_ids.shape[1] for b in batches)
        slots = max(b.regions.valid.shape[1] for b in batches)

        def pad(a: np.ndarray, width: int, value=0) -> np.ndarray:
            grow = [(0, 0), (0, width - a.shape[1])] + [(0, 0)] * (a.ndim - 2)
            return np.pad(a, grow, constant_values=value)

        targets = [b.targets for b in batches]
        return QABatch(
            ids=[i for b in batches for i in b.ids],
            token_ids=np.concatenate([pad(b.token_ids, length, pad_id) for b in batches]),
            lengths=np.concatenate([b.lengths for b in batches]),
            regions=PaddedRegions(
                np.concatenate([pad(b.regions.feats, slots) for b in batches]),
                np.concatenate([pad(b.regions.boxes, slots) for b in batches]),
                np.concatenate([pad(b.regions.valid, slots) for b in batches]),
            ),
            targets=np.concatenate(targets) if all(t is not None for t in targets) else None,
        )


class QADataset(Dataset):
    """VQA/GQA questions read a micro-batch at a time (`__getitems__`, which DataLoader and the trainer
    call): one read transaction for the regions, questions tokenised once, soft targets scattered from
    each question's (answer, score) pairs. Item i is the batch of question i alone."""

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
        self.pad_id = tokenizer.pad_token_id
        self.answers = answers
        self.labelled = np.array([e.label is not None for e in self.examples], dtype=bool)
        pairs = [sorted(answers.labels(e.label or {}).items()) for e in self.examples]
        width = max(1, max((len(p) for p in pairs), default=0))
        self.answer_ids = np.full((len(pairs), width), -1, dtype=np.int64)  # -1 pads
        self.answer_scores = np.zeros((len(pairs), width), dtype=np.float32)
        for i, p in enumerate(pairs):
            for j, (idx, score) in enumerate(p):
                self.answer_ids[i, j], self.answer_scores[i, j] = idx, score

    def __len__(self) -> int:
        return len(self.examples)

    def __getitems__(self, indices) -> QABatch:
        idx = np.asarray(indices, dtype=np.int64)
        targets = None
        if self.labelled[idx].all():
            targets = np.zeros((len(idx), len(self.answers)), dtype=np.float32)
            cols = self.answer_ids[idx]
            rows = np.broadcast_to(np.arange(len(idx))[:, None], cols.shape)
            real = cols >= 0
            targets[rows[real], cols[real]] = self.answer_scores[idx][real]
        return QABatch(
            ids=[self.examples[i].question_id for i in idx],
            token_ids=self.texts.padded(idx, self.pad_id),
            lengths=self.texts.lengths(idx),
            regions=read_regions(self.features, [self.examples[i].img_id for i in idx]),
            targets=targets,
        )

    def __getitem__(self, i: int) -> QABatch:
        return self.__getitems__([i])


def collate_qa(batch: QABatch | list[QABatch], pad_id: int = 0) -> dict:
    """Model inputs of a QA batch (or of a list of them, joined): padded text, regions padded to the
    batch's largest set (features as stored, widened on the device), soft targets if all are labelled."""
    if isinstance(batch, list):
        batch = QABatch.concat(batch, pad_id)
    ids = torch.from_numpy(batch.token_ids)
    attention = np.arange(batch.token_ids.shape[1])[None, :] < batch.lengths[:, None]
    out = {
        "input_ids": ids,
        "attention_mask": torch.from_numpy(attention.astype(np.int64)),
        "token_type_ids": torch.zeros_like(ids),
        **batch.regions.model_inputs(),
        "ids": batch.ids,
    }
    if batch.targets is not None:
        out["labels"] = torch.from_numpy(batch.targets)
    return out
