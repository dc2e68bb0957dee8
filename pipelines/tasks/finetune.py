"""What every fine-tuning task shares: its config, the trainer Task built on a model family, and the
self-contained directories it saves (model, vocab, answer table, finetune.json)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from model import CONFIG_NAME, FORMAT, family_of, get_family, read_checkpoint, read_config
from pipelines.data.answers import ANSWERS_FILE, AnswerTable
from pipelines.data.bad_records import drop_bad
from pipelines.data.columns import RowColumns
from pipelines.data.examples import Example, check_images, unlabelled_keys
from pipelines.data.image_refs import StoreImages
from pipelines.data.regions import IMAGE_SIZE, float_inputs, inputs_for
from pipelines.data.row_files import MAX_LISTED, read_row_file
from pipelines.data.text import load_tokenizer, save_tokenizer
from pipelines.engine.checkpoints import CHECKPOINTS, STATE_FILE, step_dirs
from pipelines.engine.trainer import TrainConfig
from pipelines.tasks.model_setup import check_model_overrides, data_overrides
from storage import FeatureReader

log = logging.getLogger(__name__)

RUN_FILE = "finetune.json"
DEFAULT_VOCAB = "bert-base-uncased"
DEFAULT_ARCH = "lxmert"
LABEL_FIELDS = ("answer", "answers", "label")  # where a row's label is, by task
MODEL_INPUTS = (
    "input_ids",
    "attention_mask",
    "token_type_ids",
    "visual_feats",
    "visual_pos",
    "visual_attention_mask",
    IMAGE_SIZE,
)


DEFAULT_PRESET = "base"


@dataclass
class FinetuneConfig:
    """What to fine-tune on and from; `TrainConfig` says how to optimise."""

    RANGES: ClassVar[dict[str, str]] = {
        "answer_min_count": "[1, 1000000000]",
        "max_answers": "[1, 1048576]",
        "max_length": "[1, 65536]",
        "vocab_min_count": "[1, 1000000000]",
        "scst_from_epoch": "[0, 1000000]",
        "scst_samples": "[1, 1024]",
        "beam_size": "[1, 1024]",
        "captions_per_image": "[1, 1024]",
        "scheduled_sampling_start": "[0, 1000000]",
        "scheduled_sampling_every": "[1, 1000000]",
        "scheduled_sampling_increase": "[0, 1]",
        "scheduled_sampling_max": "[0, 1]",
        "unk_penalty": ">= 0",
        "decode_max_length": "[1, 65536]",
        "test_beam_size": "[1, 1024]",
        "test_unk_penalty": ">= 0",
    }

    task: str = "vqa"  # a fine-tuning task of pipelines.tasks.TASKS
    # the model family (model.architectures.FAMILIES); None = the init directory's, else DEFAULT_ARCH
    arch: str | None = None
    features: list[str] = field(default_factory=list)
    train_files: list[str] = field(default_factory=list)
    valid_files: list[str] = field(default_factory=list)
    init: str | None = None  # a pre-training (or any checkpoint) directory; None = random weights
    # continue the optimizer state (Adam's moments and step counts) saved with the --init weights (its
    # run's trainer_state.pt), as self-critical.pytorch's --start_from continues optimizer.pth
    init_optimizer: bool = False
    preset: str | None = None  # model size without an init directory (None: base); with one, its config
    model: dict[str, Any] = field(
        default_factory=dict
    )  # model config overrides (dropout, visual_feat_dim...)
    vocab: str | None = None  # None = the init directory's vocab.txt, else bert-base-uncased
    answers: str | None = None  # ans2label JSON (trainval_ans2label.json); None = built from training labels
    answer_min_count: int = 1
    max_answers: int | None = None
    init_answers: str | None = None  # the pre-training answer table; None = looked up in the init directory
    seed_answer_head: bool = True
    max_length: int = 20  # text tokens; for captions the most words of a caption (16 for the caption task)
    skip_missing: bool = False  # drop examples whose images are not in the store instead of failing
    skip_bad_records: bool = False  # drop examples reading records that fail storage.validate
    # captioning only
    vocab_min_count: int = 5  # words seen fewer times in the training captions become <unk>
    # the captions counted for the vocabulary: train = the training examples; all = every image of the
    # training files whatever its split (self-critical.pytorch's prepro_labels.py counts all of
    # dataset_coco.json)
    vocab_from: Literal["train", "all"] = "train"
    scst_from_epoch: int | None = None  # self-critical training from this epoch on; None = cross-entropy only
    scst_samples: int = 1  # sampled captions per image in self-critical training
    # the SCST reward: cider-d = CIDEr-D of the words against the references, document frequencies of the
    # training references; self-critical = self-critical.pytorch's: token ids up to and with <eos>, against
    # references truncated to max_length with rare words as <unk>, document frequencies counting <eos>
    scst_reward: str = "cider-d"
    scst_suppress_unk: bool = True  # keep <unk> out of SCST's greedy baseline (self-critical.pytorch: no)
    captions_per_image: int = 1  # cross-entropy rows per image in a batch (self-critical.pytorch: 5)
    # scheduled sampling: from epoch `scheduled_sampling_start` (None: never), the probability of feeding
    # the model's own word rises by `scheduled_sampling_increase` every `scheduled_sampling_every` epochs
    # up to `scheduled_sampling_max`
    scheduled_sampling_start: int | None = None
    scheduled_sampling_every: int = 5
    scheduled_sampling_increase: float = 0.05
    scheduled_sampling_max: float = 0.25
    beam_size: int = 3  # beam search width for validation captions
    # None bans <unk> from beams; a number is subtracted from its log-prob (self-critical.pytorch: 1000)
    unk_penalty: float | None = None
    decode_max_length: int | None = None  # most words a decoded caption has; None = max_length
    # `xmodal evaluate`'s decoding: None = as validation (beam_size, unk_penalty)
    test_beam_size: int | None = None
    test_unk_penalty: float | None = None

    def __post_init__(self) -> None:
        check_model_overrides(self.model)
        # a run's own directory (as self-critical.pytorch's --start_from takes) stands for its final model
        run = Path(self.init) if self.init else None
        own_model = run is not None and (run / CONFIG_NAME).is_file()
        if run and not own_model and (run / CHECKPOINTS).is_dir() and (run / "last").is_dir():
            log.info("--init %s is a run directory: starting from its final model, %s", run, run / "last")
            self.init = str(run / "last")


@dataclass
class FinetuneRun:
    """The `--config` YAML: `task:` and `train:` sections, as in the run's resolved config.yaml."""

    task: FinetuneConfig = field(default_factory=FinetuneConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


class FinetuneTask:
    """A trainer Task for one fine-tuning task; loads the data and tokenizer up front.

    A subclass names its `role` in the model family, its learning rate, and how examples are read,
    turned into a dataset, collated, decoded into predictions, scored and written in the official format."""

    name: ClassVar[str]
    role: ClassVar[str]  # the model family's class for this task: models[role]
    lr: ClassVar[float]  # the release: batch 32, 4 epochs, warm-up 10 %, clip 5.0 for all; lr per task
    example_noun: ClassVar[str] = "examples"
    primary_metric = "accuracy"
    evaluators: ClassVar[tuple[str, ...]] = ()  # versions of the official script `score_files` offers
    recipes: ClassVar[tuple[str, ...]] = ()  # named settings `recipe(name)` offers (`--recipe`)
    token_cache: Path | None = None  # where tokenised text is kept; `finetune()` sets the run's cache/

    def __init__(
        self, cfg: FinetuneConfig, answers: AnswerTable | None = None, cache_dir: str | Path | None = None
    ) -> None:
        if cfg.task != self.name:
            raise ValueError(f"a {cfg.task} config given to the {self.name} task")
        if not cfg.features:
            raise ValueError("no feature store given: pass --features feats.lmdb")
        if not cfg.train_files:
            raise ValueError("no training file given: pass --train train.json")
        self.config = cfg
        self.token_cache = Path(cache_dir) if cache_dir is not None else None
        self.family = _family(cfg)
        self.features = StoreImages(FeatureReader(cfg.features))
        self.train_examples = self._load(cfg.train_files, "training data")
        self.valid_examples = self._load(cfg.valid_files, "validation data") if cfg.valid_files else []
        files = [*cfg.train_files, *cfg.valid_files]
        check_labelled(self.load_examples, files, [self.train_examples, self.valid_examples])
        self.vocab = cfg.vocab or _init_vocab(cfg.init) or DEFAULT_VOCAB
        self.tokenizer = self.text_vocabulary(cfg)
        init_vocab = _init_vocab(cfg.init)
        if cfg.vocab and init_vocab and self.tokenizer.get_vocab() != load_tokenizer(init_vocab).get_vocab():
            log.warning(
                "vocab %s differs from the one %s was pre-trained with: word ids will not match",
                self.vocab,
                cfg.init,
            )
        self.answers = self._answer_table(answers)
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

    @classmethod
    def text_vocabulary(cls, cfg: FinetuneConfig):
        """The tokenizer a run of `cfg` reads text with (`--vocab`, else the init directory's vocab.txt, else
        bert-base-uncased); `xmodal finetune` loads it before extracting any image, so a missing one fails
        in a second, not after the extraction."""
        return load_tokenizer(cfg.vocab or _init_vocab(cfg.init) or DEFAULT_VOCAB)

    # ---- what a task defines
    @staticmethod
    def load_examples(files: Sequence[str | Path]) -> list:
        """The task's rows of `files` as examples."""
        raise NotImplementedError

    @classmethod
    def read_rows(cls, files: Sequence[str | Path], cache_dir: Path | None) -> Sequence:
        """The rows a run trains on: columns (`RowColumns`, kept in `cache_dir`) where the task has them,
        else `load_examples`."""
        return cls.load_examples(files)

    @staticmethod
    def dataset(
        examples: Sequence,
        features,
        tokenizer,
        answers: AnswerTable | None,
        max_length: int,
        cache_dir: str | Path | None = None,
    ) -> Dataset:
        """The task's dataset; `cache_dir`: where tokenised text is kept (pipelines.data.token_cache)."""
        raise NotImplementedError

    @staticmethod
    def collate_items(items: list[dict], pad_id: int = 0) -> dict:
        raise NotImplementedError

    @staticmethod
    def decode(logits: torch.Tensor, answers: AnswerTable | None) -> list:
        """The predictions of a batch's logits (answer strings, or 0/1)."""
        raise NotImplementedError

    @staticmethod
    def score(predictions: dict, examples: Sequence) -> dict[str, float]:
        raise NotImplementedError

    @staticmethod
    def score_files(
        predictions: str | Path,
        gold: str | Path,
        questions: str | Path | None = None,
        evaluator: str | None = None,
    ) -> dict:
        """The official scores (pipelines.scoring) of a prediction file in the task's official format
        against a gold file; `questions`: a questions file checked against the gold (VQA); `evaluator`: one
        of the task's `evaluators` (the versions of its official script), None = its default."""
        raise NotImplementedError

    @staticmethod
    def write_predictions(path: str | Path, predictions: dict) -> Path:
        """`predictions` in the official format of the task's evaluation server or script."""
        raise NotImplementedError

    @staticmethod
    def describe(example) -> dict:
        """What a reader needs beside a prediction to know what it answers (the joined predictions)."""
        return {"id": example.key, "images": list(example.images)}

    @classmethod
    def build_head(cls, family, config, answers: AnswerTable | None) -> torch.nn.Module:
        """A randomly initialised model of the task's role."""
        return family.models[cls.role](config)

    @classmethod
    def load_head(
        cls, family, directory: str | Path, answers: AnswerTable | None, **overrides
    ) -> torch.nn.Module:
        """The task's model from a checkpoint directory (its backbone, and its head when it has one)."""
        return family.models[cls.role].from_pretrained(directory, **overrides)

    def _answer_table(self, given: AnswerTable | None) -> AnswerTable | None:
        """The answers the model chooses from; None for tasks without an answer table."""
        return None

    def _after_load(self, model: torch.nn.Module) -> None:
        """Called on a model loaded from `init` (e.g. to seed an answer head)."""

    @classmethod
    def default_train_config(cls) -> TrainConfig:
        """The release's fine-tuning recipe for this task: BertAdam, 10% warm-up, clip 5."""
        return TrainConfig(
            lr=cls.lr, optimizer="bertadam", batch_size=32, epochs=4, warmup_ratio=0.1, clip_norm=5.0
        )

    @classmethod
    def default_config(cls) -> FinetuneConfig:
        """The task section of a run with this task's defaults."""
        return FinetuneConfig(task=cls.name)

    @classmethod
    def load_outputs(cls, directory: Path, settings: dict) -> tuple[Any, AnswerTable | None]:
        """(tokenizer, answer table) of a directory this task saved."""
        answers = AnswerTable.load(directory / settings["answers"]) if settings.get("answers") else None
        return load_tokenizer(directory), answers

    # ---- setup
    def _load(self, files: list[str], what: str) -> Sequence[Example]:
        examples = self.read_rows(files, self.token_cache)
        if isinstance(examples, RowColumns):
            examples = self._usable_rows(examples, files, what)
        else:
            examples = self._usable_examples(examples, files, what)
        if not examples:
            raise ValueError(f"{what} ({', '.join(files)}) holds no usable example")
        return examples

    def _usable_examples(self, examples: list[Example], files: list[str], what: str) -> list[Example]:
        if self.config.skip_missing:
            kept = [e for e in examples if all(i in self.features for i in e.images)]
            _log_missing(what, len(examples) - len(kept))
            examples = kept
        else:
            check_images(examples, self.features, f"{what} ({', '.join(files)})", skippable=True)
        return drop_bad(examples, self._stored_ids, self.features, self.config.skip_bad_records, what)

    def _usable_rows(self, rows: RowColumns, files: list[str], what: str) -> RowColumns:
        """As `_usable_examples`, image by image of the rows' image table rather than row by row."""
        names = rows.image_names
        if self.config.skip_missing:
            kept = rows.select_images(np.array([n in self.features for n in names], dtype=bool))
            _log_missing(what, len(rows) - len(kept))
            rows = kept
        else:
            check_images(rows, self.features, f"{what} ({', '.join(files)})", skippable=True)
        skip = self.config.skip_bad_records
        return drop_bad(rows, self._stored_ids, self.features, skip, what, self.features.resolve)

    def _stored_ids(self, example: Example) -> list[str]:
        """The store's ids of an example's images (found by the one reference rule)."""
        return [self.features.resolve(img) for img in example.images]

    def _model_config(self):
        cfg = self.config
        config_class = self.family.config_class
        if cfg.init is None:
            preset = cfg.preset or DEFAULT_PRESET
            log.warning(
                "no --init: fine-tuning from RANDOM weights (%s preset); meaningless for real use", preset
            )
            # a model built here takes the store's feature width (the demo's own detector gives 256-d)
            overrides = data_overrides(
                config_class, self.tokenizer, visual_feat_dim=self.features.feature_dim
            )
            return config_class.preset(preset, **{**overrides, **cfg.model})
        if cfg.preset is not None:
            log.warning(
                "--preset %s is ignored: it sizes a model built from scratch, and with --init the model "
                "is the one in %s (change its fields with task.model.NAME=VALUE)",
                cfg.preset,
                cfg.init,
            )
        return config_class.from_dict({**_saved_model_config(Path(cfg.init)), **cfg.model})

    # ---- the Task protocol
    def build_model(self) -> torch.nn.Module:
        cfg = self.config
        if cfg.init is None:
            return self.build_head(self.family, self.model_config, self.answers)
        model = self.load_head(self.family, cfg.init, self.answers, **cfg.model)
        self._after_load(model)
        return model

    def init_trainer_states(self) -> list[Path]:
        """With `init_optimizer`, the trainer states that may hold the optimizer of the --init weights,
        best guess first: the init directory's own (a checkpoints/step-N), then its run's checkpoints,
        newest first (`RUN/last` is the final one's model); the trainer takes the one whose model they are."""
        cfg = self.config
        if not cfg.init_optimizer:
            return []
        if not cfg.init:
            raise ValueError("task.init_optimizer continues the --init run's optimizer: give --init")
        init = Path(cfg.init)
        found = [init / STATE_FILE] if (init / STATE_FILE).is_file() else []
        runs = sorted(step_dirs(init.parent / CHECKPOINTS), reverse=True)
        found += [d / STATE_FILE for _, d in runs if (d / STATE_FILE).is_file() and d != init]
        if not found:
            raise ValueError(
                f"--init {init} has no optimizer state to continue (no {STATE_FILE} in it or in "
                f"{init.parent / CHECKPOINTS}): give the earlier run's last/ or a checkpoints/step-N, as "
                "self-critical.pytorch's --start_from, or task.init_optimizer=false for a fresh optimizer"
            )
        return found

    def train_dataset(self) -> Dataset:
        return self._dataset(self.train_examples)

    def valid_dataset(self) -> Dataset | None:
        return self._dataset(self.valid_examples) if self.valid_examples else None

    def _dataset(self, examples) -> Dataset:
        return self.dataset(
            examples,
            self.features,
            self.tokenizer,
            self.answers,
            self.config.max_length,
            cache_dir=self.token_cache,
        )

    def collate(self, items: list, rng: np.random.Generator) -> dict:
        return self.collate_items(items, self.tokenizer.pad_token_id)

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        out = model(**model_inputs(batch, model), labels=batch["labels"])
        return out.loss, {}

    def evaluate(self, model: torch.nn.Module, loader: Iterable[dict]) -> dict[str, float]:
        predictions, loss = self.predict(model, loader, self.answers)
        metrics = self.score(predictions, self.valid_examples)
        if loss is not None:
            metrics["loss"] = loss
        return metrics

    @classmethod
    @torch.no_grad()
    def predict(
        cls, model: torch.nn.Module, batches: Iterable[dict], answers: AnswerTable | None
    ) -> tuple[dict, float | None]:
        """Predictions by example id and the mean loss when labelled."""
        was_training = model.training
        model.eval()
        predictions: dict = {}
        losses: list[tuple[float, int]] = []
        for batch in batches:
            out = model(**model_inputs(batch, model), labels=batch.get("labels"))
            decoded = cls.decode(out.logits.float(), answers)
            predictions.update(zip(batch["ids"], decoded, strict=True))
            if out.loss is not None:
                losses.append((float(out.loss), len(batch["ids"])))
        model.train(was_training)
        loss = sum(v * n for v, n in losses) / sum(n for _, n in losses) if losses else None
        return predictions, loss

    def save(self, model: torch.nn.Module, directory: Path) -> None:
        directory = Path(directory)
        model.save_pretrained(directory)
        save_tokenizer(self.tokenizer, directory)
        if self.answers is not None:
            self.answers.save(directory / ANSWERS_FILE)
        settings = {
            "task": self.name,
            "arch": self.family.name,
            "max_length": self.config.max_length,
            "answers": ANSWERS_FILE if self.answers is not None else None,
            "init": self.config.init,
            "features": list(self.config.features),
            "feature_dim": self.features.feature_dim,
            "detector": self.features.meta.get("provenance", {}),
        }
        (directory / RUN_FILE).write_text(json.dumps(settings, indent=2) + "\n")


def check_labelled(
    load_examples: Callable, files: Sequence[str], splits: Sequence[Sequence] | None = None
) -> None:
    """Refuse rows without a label, naming the file, why and the rows: fine-tuning learns from labels.
    `splits`: the examples (or `RowColumns`) of all `files` read together (the official VQA pair labels
    its questions only so); only in a refusal is each file read alone, for its rows and their lines."""
    files = list(dict.fromkeys(files))  # a file given as --train and --valid is read once
    splits = [load_examples(files)] if splits is None else splits
    unlabelled = {key for split in splits for key in unlabelled_keys(split)}
    if not unlabelled:
        return
    for path in files:
        own = load_examples([path])
        missing = [e for e in own if e.key in unlabelled and e.label is None]
        if missing:
            raise ValueError(_unlabelled_refusal(path, missing, len(own)))
    raise ValueError(
        f"{len(unlabelled)} training/validation examples have no label (e.g. {next(iter(unlabelled))!r}); "
        "fine-tuning needs labelled files"
    )


def _log_missing(what: str, skipped: int) -> None:
    if skipped:
        log.warning("%s: skipped %d examples whose images are not in the store", what, skipped)


def _unlabelled_refusal(path: str | Path, missing: Sequence, total: int) -> str:
    try:
        rows = read_row_file(path)
    except (ValueError, OSError):
        rows = []
    bare = [r.where for r in rows if all(r.fields.get(k) in (None, "") for k in LABEL_FIELDS)]
    columns = set().union(*(r.fields for r in rows)) if rows else set()
    why = "the file has no 'answer' column: " if rows and not columns & set(LABEL_FIELDS) else ""
    if len(bare) == len(missing):
        more = len(bare) - MAX_LISTED
        where = ", ".join(bare[:MAX_LISTED]) + (f" and {more} more" if more > 0 else "")
    else:
        where = f"e.g. {missing[0].key!r}"
    return (
        f"{path}: {len(missing)} of {total} rows have no answer ({why}{where}); fine-tuning needs "
        "labelled rows: give each an 'answer' (or 'answers', 'label')"
    )


def _family(cfg: FinetuneConfig):
    """The model family: the init directory's (a different `arch` is refused), else `arch`."""
    if cfg.init is None:
        return get_family(cfg.arch or DEFAULT_ARCH)
    architecture = read_config(cfg.init)[0]
    family = family_of(architecture)
    if cfg.arch is not None and cfg.arch != family.name:
        raise ValueError(
            f"--init {cfg.init} holds a {family.name} model ({architecture}), not {cfg.arch}; "
            "drop --arch or pick an init directory of that family"
        )
    return family


def model_inputs(batch: dict, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s keyword inputs out of a collated batch."""
    return float_inputs(inputs_for(model, {k: batch[k] for k in MODEL_INPUTS if k in batch}))


def _saved_model_config(directory: Path) -> dict:
    """The model config of a checkpoint directory, without reading its weights when it is xmodal's own."""
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
