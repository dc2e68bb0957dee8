"""Fine-tuning LXMERT on VQA, GQA and NLVR2: the trainer Tasks and the self-contained run directories."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from model import (
    CONFIG_NAME,
    FORMAT,
    LxmertConfig,
    LxmertForNLVR2,
    LxmertForQuestionAnswering,
    read_checkpoint,
)
from pipelines.answers import ANSWERS_FILE, AnswerTable
from pipelines.finetune_data import (
    NLVR2Dataset,
    NLVR2Example,
    QADataset,
    QAExample,
    check_images,
    collate_nlvr2,
    collate_qa,
    load_nlvr2_examples,
    load_qa_examples,
)
from pipelines.metrics import gqa_accuracy, nlvr2_metrics, vqa_accuracy
from pipelines.tokenization import load_tokenizer, save_tokenizer
from pipelines.trainer import TrainConfig, fit, latest_checkpoint
from storage import FeatureReader

log = logging.getLogger(__name__)

TASKS = ("vqa", "gqa", "nlvr2")
TaskName = Literal["vqa", "gqa", "nlvr2"]
# SPEC §2 fine-tuning table: lr per task; batch 32, 4 epochs, warm-up 10 %, clip 5.0 for all.
TASK_LR = {"vqa": 5e-5, "gqa": 1e-5, "nlvr2": 5e-5}
RUN_FILE = "finetune.json"
DEFAULT_VOCAB = "bert-base-uncased"
# where a pre-training directory may keep its answer table, most specific first
PRETRAIN_ANSWER_FILES = (ANSWERS_FILE, "answers.json", "answer_table.json", "trainval_ans2label.json")


@dataclass
class FinetuneConfig:
    """What to fine-tune on and from; `TrainConfig` says how to optimise."""

    task: TaskName = "vqa"
    features: list[str] = field(default_factory=list)
    train_files: list[str] = field(default_factory=list)
    valid_files: list[str] = field(default_factory=list)
    init: str | None = None  # a pre-training (or any LXMERT) directory; None = random weights
    preset: str = "base"  # model size when there is no init directory
    model: dict[str, Any] = field(
        default_factory=dict
    )  # LxmertConfig overrides (dropout, visual_feat_dim...)
    vocab: str | None = None  # None = the init directory's vocab.txt, else bert-base-uncased
    answers: str | None = None  # ans2label JSON (trainval_ans2label.json); None = built from training labels
    answer_min_count: int = 1
    max_answers: int | None = None
    init_answers: str | None = None  # the pre-training answer table; None = looked up in the init directory
    seed_answer_head: bool = True
    max_length: int = 20
    skip_missing: bool = False  # drop examples whose images are not in the store instead of failing


@dataclass
class FinetuneRun:
    """The `--config` YAML: `task:` and `train:` sections, as in the run's resolved config.yaml."""

    task: FinetuneConfig = field(default_factory=FinetuneConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


def default_train_config(task: str) -> TrainConfig:
    """The SPEC's fine-tuning schedule for `task`."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")
    return TrainConfig(lr=TASK_LR[task], batch_size=32, epochs=4, warmup_ratio=0.1, clip_norm=5.0)


def default_run(task: str) -> FinetuneRun:
    return FinetuneRun(task=FinetuneConfig(task=task), train=default_train_config(task))  # type: ignore[arg-type]


def seed_answer_head(
    head: torch.nn.Module, source: dict[str, torch.Tensor], source_answers: AnswerTable, answers: AnswerTable
) -> int:
    """Copy a pre-training QA head (`source`: its state dict) into a fine-tuning answer head.

    As the release's `load_lxmert_qa`: the hidden layers are copied whole and the output layer
    (`classifier.*`) row by row for the answers both tables hold; other rows keep their initialisation.
    Returns the number of rows copied.
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


class FinetuneTask:
    """A trainer Task for one of vqa/gqa/nlvr2; loads the data, tokenizer and answer table up front."""

    primary_metric = "accuracy"

    def __init__(self, cfg: FinetuneConfig, answers: AnswerTable | None = None) -> None:
        if cfg.task not in TASKS:
            raise ValueError(f"unknown task {cfg.task!r}; choose one of {TASKS}")
        if not cfg.features:
            raise ValueError("no feature store given: pass --features feats.lmdb")
        if not cfg.train_files:
            raise ValueError("no training file given: pass --train train.json")
        self.config = cfg
        self.features = FeatureReader(cfg.features)
        self.train_examples = self._load(cfg.train_files, "training data")
        self.valid_examples = self._load(cfg.valid_files, "validation data") if cfg.valid_files else []
        unlabelled = [e for e in self.train_examples + self.valid_examples if e.label is None]
        if unlabelled:
            raise ValueError(
                f"{len(unlabelled)} training/validation examples have no label "
                f"(e.g. {_example_id(unlabelled[0])!r}); fine-tuning needs labelled files"
            )
        self.vocab = cfg.vocab or _init_vocab(cfg.init) or DEFAULT_VOCAB
        self.tokenizer = load_tokenizer(self.vocab)
        init_vocab = _init_vocab(cfg.init)
        if cfg.vocab and init_vocab and self.tokenizer.get_vocab() != load_tokenizer(init_vocab).get_vocab():
            log.warning(
                "vocab %s differs from the one %s was pre-trained with: word ids will not match",
                self.vocab,
                cfg.init,
            )
        self.answers = None if cfg.task == "nlvr2" else self._answer_table(answers)
        self.model_config = self._model_config()
        if self.model_config.visual_feat_dim != self.features.feature_dim:
            raise ValueError(
                f"the feature store holds {self.features.feature_dim}-d features but the model expects "
                f"visual_feat_dim={self.model_config.visual_feat_dim}; use a matching store or model"
            )
        if len(self.tokenizer) > self.model_config.vocab_size:
            raise ValueError(
                f"vocab {self.vocab} has {len(self.tokenizer)} tokens, more than the model's "
                f"vocab_size={self.model_config.vocab_size}; use the pre-training vocab"
            )

    # ---- setup
    def _load(self, files: list[str], what: str) -> list[QAExample] | list[NLVR2Example]:
        loader = load_nlvr2_examples if self.config.task == "nlvr2" else load_qa_examples
        examples = loader(files)
        if self.config.skip_missing:
            kept = [e for e in examples if all(i in self.features for i in _images(e))]
            if len(kept) < len(examples):
                log.warning(
                    "%s: skipped %d examples whose images are not in the store",
                    what,
                    len(examples) - len(kept),
                )
            examples = kept
        else:
            check_images(examples, self.features, f"{what} ({', '.join(files)})")
        if not examples:
            raise ValueError(f"{what} ({', '.join(files)}) holds no usable example")
        return examples

    def _answer_table(self, given: AnswerTable | None) -> AnswerTable:
        cfg = self.config
        if given is not None:
            table = given
        elif cfg.answers:
            table = AnswerTable.load(cfg.answers)
        else:
            table = AnswerTable.build(
                (e.label for e in self.train_examples),
                min_count=cfg.answer_min_count,
                max_size=cfg.max_answers,
            )
        if len(table) == 0:
            raise ValueError("the answer table is empty; lower answer_min_count or pass --answers")
        covered = sum(bool(table.labels(e.label)) for e in self.train_examples)
        log.info(
            "answer table: %d answers, covering %d of %d training questions",
            len(table),
            covered,
            len(self.train_examples),
        )
        return table

    def _model_config(self) -> LxmertConfig:
        cfg = self.config
        if cfg.init is None:
            log.warning(
                "no --init: fine-tuning from RANDOM weights (%s preset); meaningless for real use",
                cfg.preset,
            )
            return LxmertConfig.preset(cfg.preset, **{"vocab_size": len(self.tokenizer), **cfg.model})
        return LxmertConfig.from_dict({**_saved_model_config(Path(cfg.init)), **cfg.model})

    # ---- the Task protocol
    def build_model(self) -> torch.nn.Module:
        cfg = self.config
        if cfg.task == "nlvr2":
            if cfg.init is None:
                return LxmertForNLVR2(self.model_config)
            return LxmertForNLVR2.from_pretrained(cfg.init, **cfg.model)
        assert self.answers is not None
        if cfg.init is None:
            return LxmertForQuestionAnswering(self.model_config, len(self.answers))
        model = LxmertForQuestionAnswering.from_pretrained(
            cfg.init, num_answers=len(self.answers), **cfg.model
        )
        if cfg.seed_answer_head:
            self._seed(model)
        return model

    def _seed(self, model: LxmertForQuestionAnswering) -> None:
        cfg = self.config
        assert cfg.init is not None and self.answers is not None
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

    def train_dataset(self) -> torch.utils.data.Dataset:
        return self._dataset(self.train_examples)

    def valid_dataset(self) -> torch.utils.data.Dataset | None:
        return self._dataset(self.valid_examples) if self.valid_examples else None

    def _dataset(self, examples) -> torch.utils.data.Dataset:
        return make_dataset(
            self.config.task, examples, self.features, self.tokenizer, self.answers, self.config.max_length
        )

    def collate(self, items: list, rng: np.random.Generator) -> dict:
        return collate_batch(self.config.task, items, self.tokenizer.pad_token_id)

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        out = model(**model_inputs(batch), labels=batch["labels"])
        return out.loss, {}

    def evaluate(self, model: torch.nn.Module, loader: Iterable[dict]) -> dict[str, float]:
        predictions, loss = predict(self.config.task, model, loader, self.answers)
        metrics = score(self.config.task, predictions, self.valid_examples)
        if loss is not None:
            metrics["loss"] = loss
        return metrics

    def save(self, model: torch.nn.Module, directory: Path) -> None:
        directory = Path(directory)
        model.save_pretrained(directory)
        save_tokenizer(self.tokenizer, directory)
        if self.answers is not None:
            self.answers.save(directory / ANSWERS_FILE)
        settings = {
            "task": self.config.task,
            "max_length": self.config.max_length,
            "answers": ANSWERS_FILE if self.answers is not None else None,
            "init": self.config.init,
            "features": list(self.config.features),
            "feature_dim": self.features.feature_dim,
            "detector": self.features.meta.get("provenance", {}),
        }
        (directory / RUN_FILE).write_text(json.dumps(settings, indent=2) + "\n")


def finetune(run: FinetuneRun, out_dir: str | Path, resume: bool = False) -> dict:
    """Fine-tune into `out_dir` (best/, last/, checkpoints/, metrics.jsonl); returns the run summary.

    On resume the answer table of the newest checkpoint is reused, so labels keep their meaning."""
    out_dir = Path(out_dir)
    answers = None
    latest = latest_checkpoint(out_dir / "checkpoints") if resume else None
    if latest is not None and (latest / ANSWERS_FILE).is_file():
        answers = AnswerTable.load(latest / ANSWERS_FILE)
    task = FinetuneTask(run.task, answers=answers)
    return fit(task, run.train, out_dir, resume=resume)


def make_dataset(task: str, examples, features, tokenizer, answers: AnswerTable | None, max_length: int):
    if task == "nlvr2":
        return NLVR2Dataset(examples, features, tokenizer, max_length)
    assert answers is not None
    return QADataset(examples, features, tokenizer, answers, max_length)


def collate_batch(task: str, items: list[dict], pad_id: int) -> dict:
    return collate_nlvr2(items, pad_id) if task == "nlvr2" else collate_qa(items, pad_id)


def model_inputs(batch: dict) -> dict[str, torch.Tensor]:
    """The model's keyword inputs out of a collated batch."""
    keys = (
        "input_ids",
        "attention_mask",
        "token_type_ids",
        "visual_feats",
        "visual_pos",
        "visual_attention_mask",
    )
    return {k: batch[k] for k in keys}


@torch.no_grad()
def predict(
    task: str, model: torch.nn.Module, batches: Iterable[dict], answers: AnswerTable | None
) -> tuple[dict, float | None]:
    """Predictions by example id (answer strings for QA, 0/1 for NLVR2) and the mean loss when labelled."""
    was_training = model.training
    model.eval()
    predictions: dict = {}
    losses: list[tuple[float, int]] = []
    for batch in batches:
        labels = batch.get("labels")
        out = model(**model_inputs(batch), labels=labels)
        best = out.logits.float().argmax(dim=-1).tolist()
        for ident, label in zip(batch["ids"], best, strict=True):
            predictions[ident] = int(label) if task == "nlvr2" else answers.answer(label)  # type: ignore[union-attr]
        if out.loss is not None:
            losses.append((float(out.loss), len(batch["ids"])))
    model.train(was_training)
    loss = sum(v * n for v, n in losses) / sum(n for _, n in losses) if losses else None
    return predictions, loss


def score(task: str, predictions: dict, examples) -> dict[str, float]:
    """The task's metrics: VQA soft accuracy (+ per type), GQA accuracy, NLVR2 accuracy + consistency."""
    if task == "vqa":
        return vqa_accuracy(predictions, examples)
    if task == "gqa":
        return gqa_accuracy(predictions, examples)
    return nlvr2_metrics(predictions, examples)


@dataclass
class Finetuned:
    """A fine-tuned directory loaded for evaluation or questions."""

    task: str
    model: torch.nn.Module
    tokenizer: Any
    answers: AnswerTable | None
    max_length: int
    settings: dict


def load_finetuned(directory: str | Path, device: str | torch.device = "cpu") -> Finetuned:
    """Load `best/`, `last/` or a checkpoint directory written by `FinetuneTask.save`."""
    directory = Path(directory)
    run_file = directory / RUN_FILE
    if not run_file.is_file():
        raise FileNotFoundError(
            f"{run_file} not found: {directory} is not a fine-tuned directory (use runs/<task>/best or last)"
        )
    settings = json.loads(run_file.read_text())
    task = settings["task"]
    answers = AnswerTable.load(directory / settings["answers"]) if settings.get("answers") else None
    if task == "nlvr2":
        model = LxmertForNLVR2.from_pretrained(directory)
    else:
        assert answers is not None
        model = LxmertForQuestionAnswering.from_pretrained(directory, num_answers=len(answers))
    model.to(device).eval()
    return Finetuned(task, model, load_tokenizer(directory), answers, int(settings["max_length"]), settings)


def _images(example: QAExample | NLVR2Example) -> tuple[str, ...]:
    return (example.img0, example.img1) if isinstance(example, NLVR2Example) else (example.img_id,)


def _example_id(example: QAExample | NLVR2Example):
    return example.identifier if isinstance(example, NLVR2Example) else example.question_id


def _saved_model_config(directory: Path) -> dict:
    """The LXMERT config of a checkpoint directory, without reading its weights when it is xmodal's own."""
    path = directory / CONFIG_NAME
    if path.is_file():
        meta = json.loads(path.read_text())
        if meta.get("format") == FORMAT:
            return meta["config"]
    return read_checkpoint(directory)[1]


def _init_vocab(init: str | None) -> str | None:
    if init and (Path(init) / "vocab.txt").is_file():
        return str(Path(init) / "vocab.txt")
    return None


def _find_answer_file(directory: Path) -> Path | None:
    for name in PRETRAIN_ANSWER_FILES:
        if (directory / name).is_file():
            return directory / name
    return None
