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
    pair_key,
    split_pair_key,
)
from pipelines.tasks.finetune import FinetuneTask

RECALL_AT = (1, 5, 10)


def recall_at_k(
    predictions: Mapping[str, float], examples: Sequence, ks: Sequence[int] = RECALL_AT
) -> dict[str, float]:
    """`R@k` (in %): the share of captions whose own image is among the k best scored of the split's
    images. `predictions` maps `pair_key(caption id, image id)` to a score; ties count against the caption."""
    if not examples:
        raise ValueError("no captions to score")
    gallery = list(dict.fromkeys(e.img_id for e in examples))
    hits = dict.fromkeys(ks, 0)
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
        rank = sum(s >= own for s in scores)  # 1 when no other image scores as high
        for k in ks:
            hits[k] += rank <= k
    return {f"R@{k}": 100.0 * hits[k] / len(examples) for k in ks}


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
    collate_items = staticmethod(collate_pairs)
    score = staticmethod(recall_at_k)
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
