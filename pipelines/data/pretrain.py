"""Pre-training data: the community JSON files (`img_id`, `sentf`, `labelf`) and a dataset over the store."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from pipelines.data.json_rows import read_json
from pipelines.data.shared_memory import batch_allocator
from pipelines.data.text import EncodedTexts
from storage import FeatureReader
from storage.batch import RegionBatch, concat_batches

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PretrainExample:
    """One (image, sentence) pair; `label` is the sentence's {answer: score} when it is a question."""

    img_id: str
    sentence: str
    source: str
    label: dict[str, float] | None = None


def read_pretrain_json(paths: Sequence[str | Path]) -> list[PretrainExample]:
    """One example per (image, sentence); a malformed row raises ValueError naming the file and the row."""
    examples: list[PretrainExample] = []
    for path in paths:
        path = Path(path)
        rows = read_json(path)
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of {{img_id, sentf, labelf}} rows")
        for i, row in enumerate(rows):
            examples.extend(_parse_row(row, f"{path}: row {i}"))
    return examples


def _parse_row(row: object, where: str) -> list[PretrainExample]:
    if not isinstance(row, dict):
        raise ValueError(
            f"{where}: expected an object with img_id, sentf and labelf, got {type(row).__name__}"
        )
    img_id = row.get("img_id")
    if not isinstance(img_id, str) or not img_id:
        raise ValueError(f"{where}: 'img_id' must be a non-empty string, got {img_id!r}")
    where = f"{where} (img_id {img_id!r})"
    sentf = row.get("sentf")
    if not isinstance(sentf, dict):
        raise ValueError(f"{where}: 'sentf' must map a source to a list of sentences")
    labelf = row.get("labelf") or {}
    if not isinstance(labelf, dict):
        raise ValueError(f"{where}: 'labelf' must map a source to a list of {{answer: score}}")
    out = []
    for source, sents in sentf.items():
        if not isinstance(sents, list) or not all(isinstance(s, str) for s in sents):
            raise ValueError(f"{where}: sentf[{source!r}] must be a list of strings")
        labels = labelf.get(source)
        if labels is not None and (not isinstance(labels, list) or len(labels) != len(sents)):
            raise ValueError(
                f"{where}: labelf[{source!r}] must be a list aligned with sentf[{source!r}] "
                f"({len(sents)} sentences)"
            )
        for k, sent in enumerate(sents):
            label = None
            if labels is not None:
                label = labels[k]
                if not isinstance(label, dict) or not all(
                    isinstance(a, str) and isinstance(s, (int, float)) for a, s in label.items()
                ):
                    raise ValueError(f"{where}: labelf[{source!r}][{k}] must be an {{answer: score}} object")
            out.append(PretrainExample(img_id, sent, source, label))
    return out


def check_image_ids(
    examples: list[PretrainExample], features: FeatureReader, files: Iterable[str | Path], skip_missing: bool
) -> list[PretrainExample]:
    """Every image must be in the feature sets: raise with a count and examples, or drop them."""
    ids = {e.img_id for e in examples}
    missing = sorted(i for i in ids if i not in features)
    if not missing:
        return examples
    stores = ", ".join(str(p) for p in features.paths)
    names = ", ".join(str(f) for f in files)
    if not skip_missing:
        raise ValueError(
            f"{len(missing)} of {len(ids)} image ids in {names} are not in the feature sets ({stores}), "
            f"e.g. {missing[:5]}; extract them, or pass --skip-missing to drop their sentences"
        )
    gone = set(missing)
    kept = [e for e in examples if e.img_id not in gone]
    log.warning(
        "skipping %d sentences of %d images missing from %s, e.g. %s",
        len(examples) - len(kept),
        len(missing),
        stores,
        missing[:5],
    )
    return kept


@dataclass
class PretrainBatch:
    """Examples `indices` of a PretrainDataset, column by column: their regions (one read), their own
    sentences' token ids, their answers (-100 pads) and whether each is a question."""

    indices: np.ndarray  # (B,) example indices
    regions: RegionBatch
    token_ids: np.ndarray  # (B, L) int64, right-padded with the tokenizer's pad id
    lengths: np.ndarray  # (B,) tokens of each sentence
    answer_labels: np.ndarray  # (B, K) int64, -100 = no answer
    answer_scores: np.ndarray  # (B, K) float32 soft scores
    question: np.ndarray  # (B,) bool: labelled (even with no answer in the table)
    sources: list[str]
    evaluation: bool

    @staticmethod
    def concat(batches: list[PretrainBatch], pad_id: int) -> PretrainBatch:
        """Several batches (e.g. single examples) as one."""
        width = max(b.token_ids.shape[1] for b in batches)
        answers = max(b.answer_labels.shape[1] for b in batches)

        def pad(a: np.ndarray, cols: int, value) -> np.ndarray:
            return np.pad(a, ((0, 0), (0, cols - a.shape[1])), constant_values=value)

        return PretrainBatch(
            indices=np.concatenate([b.indices for b in batches]),
            regions=concat_batches([b.regions for b in batches]),
            token_ids=np.concatenate([pad(b.token_ids, width, pad_id) for b in batches]),
            lengths=np.concatenate([b.lengths for b in batches]),
            answer_labels=np.concatenate([pad(b.answer_labels, answers, -100) for b in batches]),
            answer_scores=np.concatenate([pad(b.answer_scores, answers, 0.0) for b in batches]),
            question=np.concatenate([b.question for b in batches]),
            sources=[s for b in batches for s in b.sources],
            evaluation=batches[0].evaluation,
        )


def answer_arrays(answers: list[tuple[tuple[int, float], ...]]) -> tuple[np.ndarray, np.ndarray]:
    """Per-example ((label, score), ...) as (E, K) labels (-100 pads) and soft scores."""
    width = max(1, max((len(a) for a in answers), default=0))
    labels = np.full((len(answers), width), -100, dtype=np.int64)
    scores = np.zeros((len(answers), width), dtype=np.float32)
    for i, pairs in enumerate(answers):
        for j, (label, score) in enumerate(pairs):
            labels[i, j], scores[i, j] = label, score
    return labels, scores


class PretrainDataset(Dataset):
    """Pre-training examples read a micro-batch at a time (`__getitems__`, which DataLoader and the
    trainer call): one read transaction for all its regions, features kept float16 as stored, boxes
    normalised to [0, 1], sentences tokenised once (`texts`). Item i is the batch of example i alone.

    `evaluation` marks a validation set, for which the collator adds the QA accuracy inputs. The
    feature reader opens its LMDB lazily in whichever process reads first (each DataLoader worker)."""

    def __init__(
        self,
        examples: list[PretrainExample],
        features: FeatureReader,
        texts: EncodedTexts,
        pad_id: int,
        answers: list[tuple[tuple[int, float], ...]] | None = None,
        evaluation: bool = False,
        width: int | None = None,
    ):
        if answers is not None and len(answers) != len(examples):
            raise ValueError(f"{len(answers)} answer lists for {len(examples)} examples")
        if len(texts) != len(examples):
            raise ValueError(f"{len(texts)} tokenised sentences for {len(examples)} examples")
        self.examples = examples
        self.features = features
        self.texts, self.pad_id = texts, pad_id
        self.answer_labels, self.answer_scores = answer_arrays(answers or [() for _ in examples])
        self.question = np.array([e.label is not None for e in examples], dtype=bool)
        self.evaluation = evaluation
        self.width = width  # region slots per image (None = each batch's most boxes)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitems__(self, indices) -> PretrainBatch:
        idx = np.asarray(indices, dtype=np.int64)
        return PretrainBatch(
            indices=idx,
            regions=self.features.read_batch(
                [self.examples[i].img_id for i in idx], self.width, batch_allocator()
            ),
            token_ids=self.texts.padded(idx, self.pad_id),
            lengths=self.texts.lengths(idx),
            answer_labels=self.answer_labels[idx],
            answer_scores=self.answer_scores[idx],
            question=self.question[idx],
            sources=[self.examples[i].source for i in idx],
            evaluation=self.evaluation,
        )

    def __getitem__(self, i: int) -> PretrainBatch:
        return self.__getitems__([i])
