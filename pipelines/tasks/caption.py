"""Captioning: cross-entropy, then self-critical training (CIDEr-D reward, greedy baseline); COCO scoring."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from model import FAMILIES, get_family
from model.captioning import beam_search
from model.captioning.self_critical import self_critical_loss
from pipelines.data.captions import (
    MAX_LENGTH,
    VOCAB_FILE,
    CaptionDataset,
    CaptionExample,
    Vocabulary,
    collate_captions,
    load_caption_examples,
)
from pipelines.data.image_refs import StoreImages
from pipelines.data.regions import float_inputs
from pipelines.engine.trainer import TrainConfig
from pipelines.scoring.captions import evaluate_captions
from pipelines.scoring.cider import CiderD
from pipelines.tasks.finetune import RUN_FILE, FinetuneConfig, FinetuneTask
from storage import FeatureReader

log = logging.getLogger(__name__)

CAPTION_INPUTS = ("input_ids", "visual_feats", "visual_pos", "visual_attention_mask")


def references(examples: Iterable[CaptionExample]) -> dict[int, list[str]]:
    """Tokenised reference strings by image id, the form CIDEr-D and the Python metrics take."""
    return {e.image_id: [" ".join(c) for c in e.label] for e in examples if e.label}


class CaptionTask(FinetuneTask):
    """A caption per image; `task.scst_from_epoch` switches cross-entropy to self-critical training."""

    name = "caption"
    role = "caption"
    lr = 5e-4  # self-critical.pytorch's cross-entropy rate; SCST runs take 5e-5 (README)
    example_noun = "images"
    primary_metric = "CIDEr"

    def __init__(self, cfg: FinetuneConfig, answers: Vocabulary | None = None) -> None:
        if cfg.task != self.name:
            raise ValueError(f"a {cfg.task} config given to the {self.name} task")
        if not cfg.features:
            raise ValueError("no feature store given: pass --features feats.lmdb")
        if not cfg.train_files:
            raise ValueError("no training file given: pass --train dataset_coco.json (Karpathy split)")
        self.config = cfg
        self.family = get_family(cfg.arch)
        if self.role not in self.family.models:
            captioners = sorted(name for name, f in FAMILIES.items() if self.role in f.models)
            raise ValueError(f"--arch {cfg.arch} is not a captioner; choose one of {captioners}")
        self.features = StoreImages(FeatureReader(cfg.features))
        self.train_examples = self._load_split(cfg.train_files, "train", "training data")
        self.valid_examples = (
            self._load_split(cfg.valid_files, "val", "validation data") if cfg.valid_files else []
        )
        unlabelled = [e for e in self.train_examples if e.label is None]
        if unlabelled:
            raise ValueError(f"{len(unlabelled)} training images have no caption (e.g. {unlabelled[0].key})")
        self.vocab = answers or self._vocabulary()
        self.tokenizer = self.vocab
        self.answers = self.vocab
        self.model_config = self._model_config()
        if self.model_config.visual_feat_dim != self.features.feature_dim:
            raise ValueError(
                f"the feature store holds {self.features.feature_dim}-d features but the model expects "
                f"visual_feat_dim={self.model_config.visual_feat_dim}; use a matching store or model"
            )
        if len(self.vocab) != self.model_config.vocab_size:
            raise ValueError(
                f"the vocabulary has {len(self.vocab)} words but the model {self.model_config.vocab_size}; "
                "pass the vocab.json the model was trained with (--vocab)"
            )
        # SCST rewards: CIDEr-D with document frequencies from the training references.
        self.cider = CiderD(references(self.train_examples))
        self.self_critical = False

    # ---- setup
    def _load_split(self, files: Sequence[str], split: str, what: str) -> list[CaptionExample]:
        examples = load_caption_examples(files, split)
        missing = [e for e in examples if e.img_id not in self.features]
        if missing and self.config.skip_missing:
            log.warning("%s: skipped %d images not in the store", what, len(missing))
            examples = [e for e in examples if e.img_id in self.features]
        elif missing:
            raise ValueError(
                f"{what} ({', '.join(files)}): {len(missing)} images are not in the feature store "
                f"(e.g. {[e.img_id for e in missing[:5]]}); extract them or pass --skip-missing"
            )
        if not examples:
            raise ValueError(f"{what} ({', '.join(files)}) holds no usable image")
        return examples

    def _vocabulary(self) -> Vocabulary:
        cfg = self.config
        path = cfg.vocab or (str(Path(cfg.init) / VOCAB_FILE) if cfg.init else None)
        if path and not cfg.vocab and not Path(path).is_file():
            what = "does not exist" if not Path(cfg.init).exists() else f"has no {VOCAB_FILE}"
            raise ValueError(
                f"--init {cfg.init} {what}: it is not a captioning run's directory; give one written by "
                "`xmodal finetune caption` (its best/ or last/)"
            )
        if path:
            return Vocabulary.load(path)
        captions = [c for e in self.train_examples for c in e.label]
        vocab = Vocabulary.build(captions, cfg.vocab_min_count)
        log.info("vocabulary: %d words seen at least %d times in %d training captions",
                 len(vocab) - 4, cfg.vocab_min_count, len(captions))  # fmt: skip
        return vocab

    @classmethod
    def default_train_config(cls) -> TrainConfig:
        """As self-critical.pytorch's Up-Down recipe: lr 5e-4, no weight decay, gradient clip 0.1, 30 epochs
        (its step decay is the engine's linear decay here)."""
        return TrainConfig(
            lr=cls.lr, batch_size=32, epochs=30, warmup_ratio=0.0, clip_norm=0.1, weight_decay=0.0
        )

    @classmethod
    def default_config(cls) -> FinetuneConfig:
        """The Up-Down captioner, captions of at most 16 words as Karpathy's references."""
        return FinetuneConfig(task=cls.name, arch="updown", max_length=MAX_LENGTH)

    @classmethod
    def load_outputs(cls, directory: Path, settings: dict) -> tuple[Vocabulary, Vocabulary]:
        """The vocabulary, which is both the tokenizer and the output classes of a captioner."""
        vocab = Vocabulary.load(Path(directory) / settings.get("vocab", VOCAB_FILE))
        return vocab, vocab

    # ---- data
    load_examples = staticmethod(load_caption_examples)

    @staticmethod
    def dataset(
        examples: Sequence,
        features,
        tokenizer: Vocabulary,
        answers,
        max_length: int,
        cache_dir: str | Path | None = None,
    ) -> CaptionDataset:
        # a word vocabulary's lookups are cheap: no token cache
        return CaptionDataset(examples, features, tokenizer, max_length)

    @staticmethod
    def collate_items(items: list[dict], pad_id: int = 0) -> dict:
        return collate_captions(items, None, pad_id)

    def collate(self, items: list, rng: np.random.Generator) -> dict:
        return collate_captions(items, rng, self.vocab.pad_id)

    # ---- training
    def set_epoch(self, epoch: int) -> None:
        start = self.config.scst_from_epoch
        switched = start is not None and epoch >= start
        if switched and not self.self_critical:
            log.info("epoch %d: self-critical training (CIDEr-D reward, greedy baseline) from here on", epoch)
        self.self_critical = switched

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        if not self.self_critical:
            out = model(**float_inputs({k: batch[k] for k in CAPTION_INPUTS}), labels=batch["labels"])
            return out.loss, {}
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError("self-critical training runs in one process: set train.workers=0")
        ids = batch["ids"]

        def reward(tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            captions = [self.vocab.decode(t) for t in tokens.tolist()]
            scores = self.cider.scores((ids[r], c) for r, c in zip(rows.tolist(), captions, strict=True))
            return torch.from_numpy(scores)

        out = self_critical_loss(
            model,
            batch["visual_feats"].float(),
            batch["visual_attention_mask"],
            reward,
            samples_per_image=self.config.scst_samples,
        )
        return out.loss, {
            "reward": float(out.sample_reward.mean()),
            "greedy_reward": float(out.greedy_reward.mean()),
        }

    def evaluate(self, model: torch.nn.Module, loader: Iterable[dict]) -> dict[str, float]:
        predictions, _ = self.predict(model, loader, self.vocab, self.config.beam_size)
        return self.score(predictions, self.valid_examples, java=False)

    # ---- predictions and scores
    @classmethod
    @torch.no_grad()
    def predict(
        cls, model: torch.nn.Module, batches: Iterable[dict], answers: Vocabulary, beam_size: int = 3
    ) -> tuple[dict, float | None]:
        """The best beam's caption by image id (no loss: captions are generated, not teacher-forced)."""
        was_training = model.training
        model.eval()
        predictions: dict = {}
        for batch in batches:
            beams = beam_search(
                model, batch["visual_feats"].float(), batch["visual_attention_mask"], beam_size
            )
            predictions.update(
                zip(batch["ids"], (answers.decode(t) for t in beams.best.tolist()), strict=True)
            )
        model.train(was_training)
        return predictions, None

    @staticmethod
    def score(predictions: dict, examples: Sequence[CaptionExample], java: bool = True) -> dict[str, float]:
        """COCO caption metrics ×100 (pycocoevalcap names) of the predictions against raw references."""
        labelled = {e.image_id: e for e in examples if e.label}
        if java:
            refs = {k: list(e.raw) or [" ".join(c) for c in e.label] for k, e in labelled.items()}
        else:
            refs = references(labelled.values())
        scores = evaluate_captions(
            refs, {k: predictions[k] for k in labelled}, pretokenized=not java, java=java
        )
        for name, reason in scores.skipped.items() if java else ():  # validation skips Java on purpose
            log.warning("%s skipped: %s", name, reason)
        return {name: 100.0 * value for name, value in scores.metrics.items()}

    @staticmethod
    def describe(example: CaptionExample) -> dict:
        return {"image_id": example.image_id, "image": example.img_id, "references": list(example.raw)}

    @staticmethod
    def write_predictions(path: str | Path, predictions: dict) -> Path:
        """COCO caption results: a JSON list of `{"image_id", "caption"}` (the image's reference as its id
        when the captions file gave no COCO id)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = [{"image_id": k, "caption": c} for k, c in predictions.items()]
        path.write_text(json.dumps(rows) + "\n", encoding="utf-8")
        return path

    # ---- saved directories
    def save(self, model: torch.nn.Module, directory: Path) -> None:
        directory = Path(directory)
        model.save_pretrained(directory)
        self.vocab.save(directory / VOCAB_FILE)
        settings = {
            "task": self.name,
            "arch": self.config.arch,
            "max_length": self.config.max_length,
            "beam_size": self.config.beam_size,
            "vocab": VOCAB_FILE,
            "init": self.config.init,
            "features": list(self.config.features),
            "feature_dim": self.features.feature_dim,
            "detector": self.features.meta.get("provenance", {}),
        }
        (directory / RUN_FILE).write_text(json.dumps(settings, indent=2) + "\n")
