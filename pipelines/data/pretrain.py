"""Pre-training data: the community JSON files (`img_id`, `sentf`, `labelf`) and a dataset over the store."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from pipelines.data.corpus import PairAnswers, PretrainCorpus, PretrainExample, load_corpus
from pipelines.data.shared_memory import batch_allocator
from pipelines.data.text import EncodedTexts
from storage import FeatureReader
from storage.batch import RegionBatch, concat_batches

log = logging.getLogger(__name__)


def read_pretrain_json(paths: Sequence[str | Path]) -> list[PretrainExample]:
    """One example per (image, sentence), as objects; a malformed row raises ValueError naming the file and
    the row. Training reads the files as columns instead (`pipelines.data.corpus.load_corpus`)."""
    return list(load_corpus(paths, None))


def check_image_ids(
    examples: PretrainCorpus | list[PretrainExample],
    features: FeatureReader,
    files: Iterable[str | Path],
    skip_missing: bool,
) -> PretrainCorpus | list[PretrainExample]:
    """Every image must be in the feature sets: raise with a count and examples, or drop them."""
    if isinstance(examples, PretrainCorpus):
        used = examples.used_images().tolist()
        names = examples.images
        gone_codes = [c for c in used if names[c] not in features]
        ids, missing = used, sorted(names[c] for c in gone_codes)
    else:
        ids = {e.img_id for e in examples}
        missing = sorted(i for i in ids if i not in features)
    if not missing:
        return examples
    stores = ", ".join(str(p) for p in features.paths)
    names_of_files = ", ".join(str(f) for f in files)
    if not skip_missing:
        raise ValueError(
            f"{len(missing)} of {len(ids)} image ids in {names_of_files} are not in the feature sets "
            f"({stores}), e.g. {missing[:5]}; extract them, or pass --skip-missing to drop their sentences"
        )
    if isinstance(examples, PretrainCorpus):
        kept = examples.select(~np.isin(examples.column("image"), gone_codes))
    else:
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

    `examples` is a `PretrainCorpus` (columns that forked loader workers share without copying) or a list
    of `PretrainExample`s, held as one; `answers` each example's (label, score) pairs, as `PairAnswers`
    or a list. `evaluation` marks a validation set, for which the collator adds the QA accuracy inputs.
    The feature reader opens its LMDB lazily in whichever process reads first (each DataLoader worker)."""

    def __init__(
        self,
        examples: PretrainCorpus | list[PretrainExample],
        features: FeatureReader,
        texts: EncodedTexts,
        pad_id: int,
        answers: PairAnswers | list[tuple[tuple[int, float], ...]] | None = None,
        evaluation: bool = False,
        width: int | None = None,
    ):
        corpus = examples if isinstance(examples, PretrainCorpus) else PretrainCorpus.from_examples(examples)
        if answers is None:
            answers = PairAnswers(
                np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(len(corpus) + 1, np.int64)
            )
        elif not isinstance(answers, PairAnswers):
            answers = PairAnswers.from_lists(answers)
        if len(answers) != len(corpus):
            raise ValueError(f"{len(answers)} answer lists for {len(corpus)} examples")
        if len(texts) != len(corpus):
            raise ValueError(f"{len(texts)} tokenised sentences for {len(corpus)} examples")
        self.examples = corpus
        self.features = features
        self.texts, self.pad_id = texts, pad_id
        self.answers = answers
        self.question = corpus.column("question")
        self.evaluation = evaluation
        self.width = width  # region slots per image (None = each batch's most boxes)

    def __len__(self) -> int:
        return len(self.examples)

    def request_ahead(self, indices) -> None:
        """Ask the store now for the regions of examples `indices` (`FeatureReader.request_ahead`)."""
        self.features.request_ahead(self.examples.image_ids(np.asarray(indices, dtype=np.int64)))

    def __getitems__(self, indices) -> PretrainBatch:
        idx = np.asarray(indices, dtype=np.int64)
        answer_labels, answer_scores = self.answers.gather(idx)
        return PretrainBatch(
            indices=idx,
            regions=self.features.read_batch(self.examples.image_ids(idx), self.width, batch_allocator()),
            token_ids=self.texts.padded(idx, self.pad_id),
            lengths=self.texts.lengths(idx),
            answer_labels=answer_labels,
            answer_scores=answer_scores,
            question=np.asarray(self.question[idx], dtype=bool),
            sources=self.examples.source_names(idx),
            evaluation=self.evaluation,
        )

    def __getitem__(self, i: int) -> PretrainBatch:
        return self.__getitems__([i])
