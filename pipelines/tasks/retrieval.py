"""Caption-to-image retrieval (Flickr30k / COCO style): one caption against every image of the split,
scored by the family's matching head; Recall@1/5/10."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from pipelines.data.example_batch import as_batch
from pipelines.data.retrieval import (
    CaptionDataset,
    PairDataset,
    candidate_inputs,
    collate_candidates,
    collate_pairs,
    load_retrieval_examples,
    load_retrieval_rows,
    pair_key,
    split_pair_key,
)
from pipelines.scoring.inputs import ScoringInputError
from pipelines.scoring.retrieval import RECALL_AT, ranks_of_rankings, read_rankings, recall_from_ranks
from pipelines.tasks.finetune import FinetuneTask


def recall_at_k(
    predictions: Mapping[str, float], examples: Sequence, ks: Sequence[int] = RECALL_AT
) -> dict[str, float]:
    """`R@k` (in %): the share of captions whose own image is among the k best scored of the split's
    images. `predictions` maps `pair_key(caption id, image id)` to a score; ties count against the caption."""
    if not examples:
        raise ValueError("no captions to score")
    gallery = list(dict.fromkeys(e.img_id for e in examples))
    ranks: dict[str, int | None] = {}
    for ex in examples:
        if ex.label is None:
            raise ValueError(f"caption {ex.caption_id!r} has no label; cannot score")
        scores = []
        for img in gallery:
            key = pair_key(ex.caption_id, img)
            if key not in predictions:
                raise ValueError(
                    f"caption {ex.caption_id!r} has no score for image {img!r}; predict every pair"
                )
            scores.append(predictions[key])
        own = predictions[pair_key(ex.caption_id, ex.label)]
        ranks[ex.caption_id] = sum(s >= own for s in scores)  # 1 when no other image scores as high
    return recall_from_ranks(ranks, ks)


def score_rankings_files(
    predictions: str | Path,
    gold: str | Path,
    questions: str | Path | None = None,
    evaluator: str | None = None,
) -> dict[str, float]:
    """R@1/5/10 of a rankings file (`write_rankings`) against the split's captions (any file
    `load_retrieval_examples` reads), through the same recall as validation."""
    if questions is not None:
        raise ScoringInputError(f"{questions}: retrieval has no questions file; the captions are the gold")
    examples = load_retrieval_examples(gold)
    if not examples:
        raise ScoringInputError(f"{gold}: no captions to score against")
    unlabelled = [e.caption_id for e in examples if e.label is None]
    if unlabelled:
        raise ScoringInputError(f"{gold}: caption {unlabelled[0]!r} has no image; cannot score")
    gallery = len({e.img_id for e in examples})
    own = {e.caption_id: e.label for e in examples}
    ranks = ranks_of_rankings(read_rankings(predictions), own, gallery, RECALL_AT, str(gold))
    return {**recall_from_ranks(ranks), "captions": len(ranks), "images": gallery}


def write_rankings(path: str | Path, predictions: Mapping[str, float], top: int = max(RECALL_AT)) -> Path:
    """JSON list of `{"caption_id": str, "images": [the `top` best image ids, best first]}`."""
    by_caption: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for key, score in predictions.items():
        caption, img = split_pair_key(key)
        by_caption[caption].append((score, img))
    rows = [
        {"caption_id": caption, "images": [img for _, img in sorted(pairs, key=lambda p: -p[0])[:top]]}
        for caption, pairs in by_caption.items()
    ]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows) + "\n", encoding="utf-8")
    return path


class RetrievalTask(FinetuneTask):
    """Trains on each caption against its image and in-batch negatives (cross-entropy over the
    candidates); evaluates every caption x image pair of the split (so captions x images forward passes:
    keep validation splits small, the 1k-image test sets are for `xmodal evaluate`)."""

    name = "retrieval"
    role = "retrieval"
    lr = 2e-5  # vilbert-multi-task's retrieval fine-tuning rate
    example_noun = "captions"
    primary_metric = "R@1"

    load_examples = staticmethod(load_retrieval_examples)
    read_rows = staticmethod(load_retrieval_rows)
    collate_items = staticmethod(collate_pairs)
    score = staticmethod(recall_at_k)
    score_files = staticmethod(score_rankings_files)
    write_predictions = staticmethod(write_rankings)

    @staticmethod
    def dataset(
        examples: Sequence, features, tokenizer, answers: None, max_length: int, cache_dir=None
    ) -> PairDataset:
        return PairDataset(examples, features, tokenizer, max_length, cache_dir)

    @staticmethod
    def decode(logits: torch.Tensor, answers: None) -> list[float]:
        return logits[:, 0].tolist()

    def train_dataset(self) -> Dataset:
        return CaptionDataset(
            self.train_examples, self.features, self.tokenizer, self.config.max_length, self.token_cache
        )

    def collate(self, items: list, rng: np.random.Generator) -> dict:
        pad = self.tokenizer.pad_token_id
        batch = as_batch(items, pad)
        # training captions carry no pair label; validation pairs always do (unlabelled files are refused)
        if batch.labels is None:
            return collate_candidates(batch, pad, rng)
        return collate_pairs(batch, pad)

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        return super().loss(model, candidate_inputs(batch) if "candidates" in batch else batch)
