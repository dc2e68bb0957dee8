"""Pre-training as a trainer Task over the feature store: the objectives the family's pre-training model
takes (LXMERT's five, ViLBERT's three)."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from model import get_family
from pipelines.data.answers import ANSWERS_FILE, AnswerTable, normalize_answer
from pipelines.data.bad_records import bad_records
from pipelines.data.corpus import PairAnswers, PretrainCorpus, corpus_texts, load_corpus
from pipelines.data.masking import MaskingConfig, PretrainCollator, apply_object_masking
from pipelines.data.pretrain import PretrainDataset, check_image_ids
from pipelines.data.regions import IMAGE_SIZE, float_inputs, inputs_for
from pipelines.data.text import EncodedTexts, load_tokenizer, save_tokenizer, write_vocab
from pipelines.engine.checkpoints import latest_checkpoint
from pipelines.engine.launch import fit
from pipelines.engine.trainer import TrainConfig
from pipelines.jobs.ray_runtime import ray_for_workers
from pipelines.tasks.model_setup import check_model_overrides, data_overrides
from storage import FeatureReader

if TYPE_CHECKING:
    from model import PreTrainingOutput

log = logging.getLogger(__name__)

MODEL_INPUTS = (
    "input_ids",
    "attention_mask",
    "token_type_ids",
    "visual_feats",
    "visual_pos",
    "visual_attention_mask",
    IMAGE_SIZE,
    "lm_labels",
    "matched_labels",
    "obj_labels",
    "obj_weights",
    "attr_labels",
    "attr_weights",
    "feat_targets",
    "feat_weights",
    "answer_labels",
    "region_mask",
    "region_probs",
    "region_labels",
    "region_weights",
)
# masking switch -> the label the pre-training model must take for it to be on
OBJECTIVE_LABELS = {
    "mlm": "lm_labels",
    "matched": "matched_labels",
    "obj": "obj_labels",
    "attr": "attr_labels",
    "feat": "feat_targets",
    "qa": "answer_labels",
    "regions": "region_mask",
}


@dataclass
class PretrainConfig:
    """What to pre-train on and how; training hyper-parameters live in `TrainConfig`."""

    RANGES: ClassVar[dict[str, str]] = {
        "answer_min_count": "[1, 1000000000]",
        "max_answers": "[1, 1048576]",
        "qa_from_epoch": "[0, 1000000]",
        "qa_weight": "[0, 1000]",
    }

    features: list[str] = field(default_factory=list)
    train_files: list[str] = field(default_factory=list)
    valid_files: list[str] = field(default_factory=list)
    skip_missing: bool = False
    skip_bad_records: bool = (
        False  # drop the sentences of records failing storage.validate instead of failing
    )
    arch: str = "lxmert"  # the model family (model.architectures.FAMILIES)
    vocab: str = "bert-base-uncased"  # a vocab.txt, a directory holding one, or a hub id
    preset: str = "base"
    model: dict[str, Any] = field(default_factory=dict)  # model config overrides, e.g. {hidden_size: 256}
    answers: str | None = None  # an ans2label/label2ans JSON to load instead of building the table
    answer_min_count: int = 1
    max_answers: int | None = 9500  # the release's QA head size; most frequent answers first
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    # the release runs QA from the start (0); the paper adds it at epoch 10 of 20
    qa_from_epoch: int = 0
    qa_weight: float = 1.0
    # where the JSON files converted into memory-mapped columns (keyed by the files' paths, sizes and
    # mtimes) and their token ids (and the vocab) are kept between runs; None = converted into memory
    # each time, except that `pretrain()` keeps them in the run directory's cache/
    token_cache: str | None = None

    def __post_init__(self) -> None:
        check_model_overrides(self.model)


def _masking_for(pretraining: type, masking: MaskingConfig) -> MaskingConfig:
    """`masking` with the objectives the pre-training model takes no labels for switched off, and the
    model's own region-masking rule (`REGION_MASKING` = shares zeroed / swapped) and word-masking rule
    (`WHOLE_WORD_MASKING`) where none is given."""
    accepted = set(inspect.signature(pretraining.forward).parameters)
    changes: dict[str, Any] = {n: False for n, label in OBJECTIVE_LABELS.items() if label not in accepted}
    dropped = sorted(name for name in changes if getattr(masking, name))
    if dropped:
        log.info(
            "%s has no %s objective: task.masking.%s off (the others stay on)",
            pretraining.__name__,
            "/".join(dropped),
            "/".join(dropped),
        )
    zero, swap = getattr(pretraining, "REGION_MASKING", (None, None))
    if masking.object_zero is None and masking.object_swap is None:
        changes |= {"object_zero": zero, "object_swap": swap}
    if masking.whole_words is None:
        changes["whole_words"] = bool(getattr(pretraining, "WHOLE_WORD_MASKING", False))
    return dataclasses.replace(masking, **changes)


def default_train_config() -> TrainConfig:
    """The paper's recipe: BertAdam, lr 1e-4, batch 256, 20 epochs, 5% linear warm-up then decay,
    clip 1.0, decay 0.01 on all parameters."""
    return TrainConfig(
        lr=1e-4,
        optimizer="bertadam",
        batch_size=256,
        epochs=20,
        warmup_ratio=0.05,
        weight_decay=0.01,
        clip_norm=1.0,
    )


@dataclass
class PretrainRun:
    """The whole run as written to config.yaml: `train.*` and `task.*` keys."""

    train: TrainConfig = field(default_factory=default_train_config)
    task: PretrainConfig = field(default_factory=PretrainConfig)


class PretrainTask:
    """Reads the JSON files and checks ids on construction; the store is opened lazily in each worker."""

    name = "pretrain"
    primary_metric = None

    def __init__(self, cfg: PretrainConfig, tokenizer=None, answers: AnswerTable | None = None):
        if not cfg.features or not cfg.train_files:
            raise ValueError("pre-training needs feature stores (--features) and training files (--train)")
        self.config = cfg
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.vocab)
        self.features = FeatureReader(cfg.features)
        # the files as memory-mapped columns, converted once into the token cache's folder
        train = check_image_ids(
            load_corpus(cfg.train_files, cfg.token_cache), self.features, cfg.train_files, cfg.skip_missing
        )
        valid = None
        if cfg.valid_files:
            valid = check_image_ids(
                load_corpus(cfg.valid_files, cfg.token_cache),
                self.features,
                cfg.valid_files,
                cfg.skip_missing,
            )
        train = _drop_bad(train, self.features, cfg.skip_bad_records, "training sentences")
        if valid is not None:
            valid = _drop_bad(valid, self.features, cfg.skip_bad_records, "validation sentences")
        valid = valid or None
        if not train:
            raise ValueError(f"no usable training sentence is left in {', '.join(cfg.train_files)}")
        if answers is None:
            if cfg.answers:
                answers = AnswerTable.load(cfg.answers)
            else:
                counts = train.answer_counts(normalize_answer)
                answers = AnswerTable.from_counts(counts, cfg.answer_min_count, cfg.max_answers)
        self.answers = answers
        self.train_examples, self.valid_examples = train, valid if valid is not None else []
        self.family = get_family(cfg.arch)
        masking = _masking_for(self.family.models["pretraining"], cfg.masking)
        if masking.regions and self.features[train[0].img_id].class_probs is None:
            log.info(
                "%s holds no per-region class distribution (RegionFeatures.class_probs): masked regions "
                "are trained on the top class weighted by its confidence",
                ", ".join(cfg.features),
            )
        if masking.qa and len(answers) == 0:
            log.warning("no answer in the training labels: image QA is switched off")
            masking = dataclasses.replace(masking, qa=False)
        if masking.obj or masking.attr:
            _warn_unlabelled(self.features)
        # tokenised once per run (or read back from the cache), sliced per batch
        length = masking.max_seq_len
        self.train_texts = self._texts(train, length)
        self.valid_texts = self._texts(valid, length) if valid else None
        self.collator = PretrainCollator(
            self.tokenizer, train, self.features.max_boxes, masking, texts=self.train_texts, held=valid or ()
        )
        self.set_epoch(0)
        log.info(
            "pre-training on %d sentences (%d images), %d validation sentences, %d answers",
            len(train),
            len(train.used_images()),
            len(valid or ()),
            len(answers),
        )

    # ---- Task protocol
    def build_model(self) -> torch.nn.Module:
        family = self.family
        overrides = data_overrides(
            family.config_class,
            self.tokenizer,
            visual_feat_dim=self.features.feature_dim,
            num_qa_labels=max(1, len(self.answers)),
        )
        overrides |= self.config.model
        return family.models["pretraining"](family.config_class.preset(self.config.preset, **overrides))

    def train_dataset(self) -> PretrainDataset:
        answers = self._answer_labels(self.train_examples)
        return self._dataset(self.train_examples, self.train_texts, answers, evaluation=False)

    def valid_dataset(self) -> PretrainDataset | None:
        if not self.valid_examples:
            return None
        answers = self._answer_labels(self.valid_examples)
        return self._dataset(self.valid_examples, self.valid_texts, answers, evaluation=True)

    def collate(self, items: list, rng: np.random.Generator) -> dict:
        return self.collator(items, rng)

    @property
    def qa_active(self) -> bool:
        """Whether QA trains this epoch (`task.qa_from_epoch`); the collator holds it, as it builds
        validation's clean QA inputs only while QA is on."""
        return self.collator.qa_active

    def set_epoch(self, epoch: int) -> None:
        self.collator.qa_active = epoch >= self.config.qa_from_epoch

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out, total = self._forward(model, batch)
        return total, {k: v.detach() for k, v in out.losses.items()}  # read by the trainer when it logs

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, loader) -> dict[str, float]:
        """Means over the validation batches of the loss (weighted as in training) and of each task's loss;
        matching accuracy over the batches' (seeded) mismatches; QA accuracy as VQA scores it, the mean
        soft score of the predicted answer (`qa_accuracy`, and `qa_accuracy/<source>` per `sentf` source;
        a question none of whose answers is in the table scores 0). Nothing about QA is reported before
        QA starts.

        The release reads the answers off the main pass, whose words and objects are masked and whose
        sentences are half swapped for another image's (yet scored against their own labels). Here every
        question is asked once more, clean and about its own image (one more forward pass over the
        questions), so the number measures the QA head, not its guesses through the masks and swaps."""
        sums: dict[str, float] = {}
        batches = 0
        matched = [0, 0]
        qa: dict[str, list[float]] = {}  # source -> [sum of soft scores, questions]
        for batch in loader:
            out, total = self._forward(model, batch)
            batches += 1
            sums["loss"] = sums.get("loss", 0.0) + float(total)
            for k, v in out.losses.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            if out.matched_logits is not None and "matched_labels" in batch:
                labels = batch["matched_labels"]
                matched[0] += int((out.matched_logits.argmax(-1) == labels).sum())
                matched[1] += labels.numel()
            if "qa_eval" in batch:  # built only while QA is on
                scores = _predicted_answer_scores(model, batch)
                for source, score in zip(batch["qa_eval_sources"], scores.tolist(), strict=True):
                    acc = qa.setdefault(source, [0.0, 0])
                    acc[0] += score
                    acc[1] += 1
        metrics = {k: v / max(batches, 1) for k, v in sums.items()}
        if matched[1]:
            metrics["matched_accuracy"] = matched[0] / matched[1]
        if qa:
            metrics["qa_accuracy"] = sum(s for s, _ in qa.values()) / sum(n for _, n in qa.values())
            for source, (score, n) in sorted(qa.items()):
                metrics[f"qa_accuracy/{source}"] = score / n
        return metrics

    def _forward(self, model: torch.nn.Module, batch: dict) -> tuple[PreTrainingOutput, torch.Tensor]:
        """The model on the batch (without QA labels before QA starts) and the loss with `qa_weight`."""
        inputs = apply_object_masking(float_inputs(batch))
        inputs = inputs_for(model, {k: inputs[k] for k in MODEL_INPUTS if k in inputs})
        if not self.qa_active:
            inputs.pop("answer_labels", None)
        out = model(**inputs)
        total = out.loss
        if "qa" in out.losses and self.config.qa_weight != 1.0:
            total = total + (self.config.qa_weight - 1.0) * out.losses["qa"]
        return out, total

    def save(self, model: torch.nn.Module, directory: Path) -> None:
        model.save_pretrained(directory)
        save_tokenizer(self.tokenizer, directory)
        self.answers.save(Path(directory) / ANSWERS_FILE)

    # ----
    def _texts(self, corpus: PretrainCorpus, length: int) -> EncodedTexts:
        return corpus_texts(corpus, self.tokenizer, length, self.config.token_cache)

    def _dataset(self, examples, texts, answers, evaluation: bool) -> PretrainDataset:
        pad = self.tokenizer.pad_token_id
        width = self.features.max_boxes
        return PretrainDataset(examples, self.features, texts, pad, answers, evaluation, width)

    def _answer_labels(self, corpus: PretrainCorpus) -> PairAnswers:
        return corpus.answer_labels(self.answers)


def _drop_bad(corpus: PretrainCorpus, features: FeatureReader, skip: bool, what: str) -> PretrainCorpus:
    """`corpus` without the pairs reading a record that fails storage.validate (see `bad_records`)."""
    used = corpus.used_images().tolist()
    bad = bad_records(features, [corpus.images[c] for c in used], skip)
    if not bad:
        return corpus
    kept = corpus.select(~np.isin(corpus.column("image"), [c for c in used if corpus.images[c] in bad]))
    log.warning(
        "%s: skipped %d of %d examples reading %d bad records (--skip-bad-records)",
        what,
        len(corpus) - len(kept),
        len(corpus),
        len(bad),
    )
    return kept


def _predicted_answer_scores(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """(Q,) soft score of the QA head's top answer for each question of `batch["qa_eval"]`."""
    predicted = model.qa_head(model.lxmert(**float_inputs(batch["qa_eval"])).pooled_output).argmax(-1)
    hit = batch["qa_eval_answers"] == predicted[:, None]
    return (batch["qa_eval_scores"].float() * hit).sum(-1)


def pretrain(run: PretrainRun, out_dir: str | Path, resume: bool = False) -> dict:
    """Pre-train into `out_dir`; vocab and answer table go to the run directory before training starts.

    On resume the run directory's own vocab and answer table are used, so labels keep their meaning."""
    out_dir = Path(out_dir)
    cfg = run.task
    if not resume and latest_checkpoint(out_dir / "checkpoints") is not None:
        raise FileExistsError(
            f"{out_dir} already holds a pre-training run; pass --resume to continue it or use another --out"
        )
    tokenizer = answers = None
    if resume and (out_dir / "vocab.txt").is_file():
        tokenizer = load_tokenizer(out_dir / "vocab.txt")
    if resume and (out_dir / ANSWERS_FILE).is_file():
        answers = AnswerTable.load(out_dir / ANSWERS_FILE)
    if cfg.token_cache is None:
        cfg = dataclasses.replace(cfg, token_cache=str(out_dir / "cache"))
    task = PretrainTask(cfg, tokenizer=tokenizer, answers=answers)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank runs this; one writes
        out_dir.mkdir(parents=True, exist_ok=True)
        if not resume or not (out_dir / "vocab.txt").is_file():
            write_vocab(task.tokenizer, out_dir / "vocab.txt")
        task.answers.save(out_dir / ANSWERS_FILE)
    with ray_for_workers(run.train.workers, run.train.ray_address):
        return fit(task, run.train, out_dir, resume=resume)


def _warn_unlabelled(features: FeatureReader) -> None:
    """Say once per store that records imported without detector labels train no obj/attr loss."""
    for shard in features.shards:
        meta = shard.read_meta()
        unlabelled = meta.get("provenance", {}).get("unlabelled_records", 0)
        if unlabelled:
            log.warning(
                "%s: %d of %d records have no detector labels (imported from a 6-field TSV or HDF5): "
                "the object and attribute losses are off for their regions (weight 0)",
                shard.path,
                unlabelled,
                meta.get("count", unlabelled),
            )
