"""Question answering over an answer table: VQA (soft scores) and GQA (one answer) share one base."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from model import read_checkpoint
from pipelines.data.answers import ANSWERS_FILE, AnswerTable, normalize_answer
from pipelines.data.qa import QADataset, QARows, collate_qa, load_qa_examples, load_qa_rows
from pipelines.scoring.gqa import score_gqa_files
from pipelines.scoring.inputs import ScoringInputError
from pipelines.scoring.vqa import DEFAULT_EVALUATOR, EVALUATORS, score_vqa_files
from pipelines.tasks.finetune import FinetuneTask
from pipelines.tasks.metrics import gqa_accuracy, vqa_accuracy
from pipelines.tasks.predictions import write_gqa_predictions, write_vqa_predictions

log = logging.getLogger(__name__)

# where a pre-training directory may keep its answer table, most specific first
PRETRAIN_ANSWER_FILES = (ANSWERS_FILE, "answers.json", "answer_table.json", "trainval_ans2label.json")


class QATask(FinetuneTask):
    """Questions about one image, answered by classifying over an answer table (BCE on soft scores)."""

    role = "qa"
    example_noun = "questions"
    answers: AnswerTable

    load_examples = staticmethod(load_qa_examples)
    read_rows = staticmethod(load_qa_rows)
    collate_items = staticmethod(collate_qa)

    @staticmethod
    def dataset(
        examples: Sequence, features, tokenizer, answers: AnswerTable, max_length: int, cache_dir=None
    ) -> QADataset:
        return QADataset(examples, features, tokenizer, answers, max_length, cache_dir)

    @staticmethod
    def describe(example) -> dict:
        gold = sorted(example.label, key=example.label.get, reverse=True) if example.label else None
        return {
            "question_id": example.question_id,
            "image": example.img_id,
            "question": example.sent,
            "answers": gold,
        }

    @staticmethod
    def decode(logits: torch.Tensor, answers: AnswerTable) -> list[str]:
        return [answers.answer(i) for i in logits.argmax(dim=-1).tolist()]

    @classmethod
    def build_head(cls, family, config, answers: AnswerTable) -> torch.nn.Module:
        return family.models[cls.role](config, num_answers=len(answers))

    @classmethod
    def load_head(cls, family, directory: str | Path, answers: AnswerTable, **overrides) -> torch.nn.Module:
        return family.models[cls.role].from_pretrained(directory, num_answers=len(answers), **overrides)

    def _answer_table(self, given: AnswerTable | None) -> AnswerTable:
        cfg = self.config
        if given is not None:
            table = given
        elif cfg.answers:
            table = AnswerTable.load(cfg.answers)
        elif isinstance(self.train_examples, QARows):
            counts = self.train_examples.answer_counts(normalize_answer)
            table = AnswerTable.from_counts(counts, min_count=cfg.answer_min_count, max_size=cfg.max_answers)
        else:
            table = AnswerTable.build(
                (e.label for e in self.train_examples),
                min_count=cfg.answer_min_count,
                max_size=cfg.max_answers,
            )
        if len(table) == 0:
            raise ValueError("the answer table is empty; lower answer_min_count or pass --answers")
        if isinstance(self.train_examples, QARows):
            covered = int(np.count_nonzero(np.diff(self.train_examples.answer_labels(table).offsets)))
        else:
            covered = sum(bool(table.labels(e.label)) for e in self.train_examples)
        log.info(
            "answer table: %d answers, covering %d of %d training questions",
            len(table),
            covered,
            len(self.train_examples),
        )
        unreachable = unreachable_answers(self.valid_examples, table)
        if unreachable:
            top = ", ".join(f"{a!r} ({n})" for a, n in unreachable.most_common(5))
            log.warning(
                "%d of %d validation answers are not in the answer table: they can never be right (%s)",
                sum(unreachable.values()),
                len(self.valid_examples),
                top,
            )
        return table

    def _after_load(self, model: torch.nn.Module) -> None:
        """Seed the answer head from the init directory's pre-training QA head, when asked and possible."""
        cfg = self.config
        if not cfg.seed_answer_head or cfg.init is None:
            return
        _, _, _, state = read_checkpoint(Path(cfg.init))
        head = {k[len("qa_head.") :]: v for k, v in state.items() if k.startswith("qa_head.")}
        table_path = Path(cfg.init_answers) if cfg.init_answers else _find_answer_file(Path(cfg.init))
        if not head:
            log.info("%s has no pre-training QA head: the answer head starts fresh", cfg.init)
            return
        if table_path is None:
            log.warning(
                "%s has a pre-training QA head but no answer table (%s), so its rows cannot be matched to "
                "answers: the answer head starts fresh. Pass the head's table with "
                "task.init_answers=all_ans.json (--init-answers), or convert the release with "
                "`xmodal convert lxmert Epoch20_LXRT.pth DIR --answers all_ans.json`",
                cfg.init,
                " / ".join(PRETRAIN_ANSWER_FILES),
            )
            return
        copied = seed_answer_head(model.answer_head, head, AnswerTable.load(table_path), self.answers)
        log.info("answer head seeded from %s: %d of %d answers shared", table_path, copied, len(self.answers))


class VQATask(QATask):
    """VQA v2: soft-score accuracy (+ per answer type); EvalAI result files."""

    name = "vqa"
    lr = 5e-5
    evaluators = EVALUATORS
    score = staticmethod(vqa_accuracy)
    write_predictions = staticmethod(write_vqa_predictions)

    @staticmethod
    def score_files(
        predictions: str | Path,
        gold: str | Path,
        questions: str | Path | None = None,
        evaluator: str | None = None,
    ) -> dict:
        return score_vqa_files(predictions, gold, questions, evaluator or DEFAULT_EVALUATOR)


class GQATask(QATask):
    """GQA: exact-match accuracy; `{questionId, prediction}` result files."""

    name = "gqa"
    lr = 1e-5
    score = staticmethod(gqa_accuracy)
    write_predictions = staticmethod(write_gqa_predictions)

    @staticmethod
    def score_files(
        predictions: str | Path,
        gold: str | Path,
        questions: str | Path | None = None,
        evaluator: str | None = None,
    ) -> dict:
        if questions is not None:
            raise ScoringInputError(
                f"{questions}: GQA's questions file is its gold (the answers are in it): give it as --gold"
            )
        return score_gqa_files(predictions, gold)


def unreachable_answers(examples: Sequence, table: AnswerTable) -> Counter[str]:
    """The best answer of each labelled question the table cannot give, counted by answer."""
    out: Counter[str] = Counter()
    for e in examples:
        if e.label and not table.labels(e.label):
            out[max(e.label, key=e.label.get)] += 1
    return out


def seed_answer_head(
    head: torch.nn.Module, source: dict[str, torch.Tensor], source_answers: AnswerTable, answers: AnswerTable
) -> int:
    """Copy a pre-training QA head (`source`: its state dict) into a fine-tuning answer head.

    As the release's `load_lxmert_qa`: the hidden layers are copied whole and the output layer
    (`classifier.*`) row by row for the answers both tables hold (matched after the release's answer
    normalisation); the rows of answers the pre-training table lacks are zeroed (weight and bias), so
    those answers start at logit 0. Returns the number of rows copied.
    """
    own = head.state_dict()
    missing = sorted(set(own) - set(source))
    if missing:
        raise ValueError(f"the pre-training QA head lacks {missing}; cannot seed the answer head")
    rows = [(i, source_answers.get(a)) for i, a in enumerate(answers.answers)]
    rows = [(i, j) for i, j in rows if j is not None]
    with torch.no_grad():
        for name, value in own.items():
            src = source[name].to(value.dtype)
            if name.startswith("classifier."):
                if src.shape[1:] != value.shape[1:] or src.shape[0] != len(source_answers):
                    raise ValueError(
                        f"QA head {name} is {tuple(src.shape)} but the pre-training table has "
                        f"{len(source_answers)} answers; pass the matching table"
                    )
                value.zero_()
                if rows:
                    dst_idx = torch.tensor([i for i, _ in rows])
                    src_idx = torch.tensor([j for _, j in rows])
                    value[dst_idx] = src[src_idx]
            elif src.shape != value.shape:
                raise ValueError(
                    f"QA head {name} is {tuple(src.shape)}, the answer head's {tuple(value.shape)}"
                )
            else:
                value.copy_(src)
    head.load_state_dict(own)
    return len(rows)


def _find_answer_file(directory: Path) -> Path | None:
    for name in PRETRAIN_ANSWER_FILES:
        if (directory / name).is_file():
            return directory / name
    return None
