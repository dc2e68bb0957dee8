"""NLVR2: is a statement true of an image pair? Two-way classification; accuracy and consistency."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from pipelines.data.nlvr2 import NLVR2Dataset, collate_nlvr2, load_nlvr2_examples, load_nlvr2_rows
from pipelines.scoring.inputs import ScoringInputError
from pipelines.scoring.nlvr2 import score_nlvr2_files
from pipelines.tasks.finetune import FinetuneTask
from pipelines.tasks.metrics import nlvr2_metrics
from pipelines.tasks.predictions import write_nlvr2_predictions


class NLVR2Task(FinetuneTask):
    """Statements about image pairs; predictions are 0/1, written as the official CSV."""

    name = "nlvr2"
    role = "nlvr2"
    lr = 5e-5
    example_noun = "statements"

    load_examples = staticmethod(load_nlvr2_examples)
    read_rows = staticmethod(load_nlvr2_rows)
    collate_items = staticmethod(collate_nlvr2)
    score = staticmethod(nlvr2_metrics)
    write_predictions = staticmethod(write_nlvr2_predictions)

    @staticmethod
    def score_files(
        predictions: str | Path,
        gold: str | Path,
        questions: str | Path | None = None,
        evaluator: str | None = None,
    ) -> dict:
        if questions is not None:
            raise ScoringInputError(f"{questions}: NLVR2 has no questions file; the statements are the gold")
        return score_nlvr2_files(predictions, gold)

    @staticmethod
    def dataset(
        examples: Sequence, features, tokenizer, answers: None, max_length: int, cache_dir=None
    ) -> NLVR2Dataset:
        return NLVR2Dataset(examples, features, tokenizer, max_length, cache_dir)

    @staticmethod
    def decode(logits: torch.Tensor, answers: None) -> list[int]:
        return [int(label) for label in logits.argmax(dim=-1).tolist()]
