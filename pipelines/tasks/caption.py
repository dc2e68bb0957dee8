"""Captioning: cross-entropy, then self-critical training (CIDEr-D reward, greedy baseline); COCO scoring."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from model import FAMILIES, get_family
from model.captioning import beam_search
from model.captioning.self_critical import self_critical_loss
from pipelines.data.captions import (
    MAX_LENGTH,
    SPLIT_SEPARATOR,
    VOCAB_FILE,
    CaptionDataset,
    CaptionExample,
    CaptionRows,
    Vocabulary,
    collate_captions,
    load_caption_examples,
    load_caption_rows,
    read_caption_file,
    split_spec,
)
from pipelines.data.image_refs import StoreImages
from pipelines.data.regions import float_inputs
from pipelines.engine.trainer import TrainConfig
from pipelines.scoring.captions import CaptionScores, evaluate_captions, read_caption_results
from pipelines.scoring.cider import CiderD
from pipelines.scoring.inputs import ScoringInputError
from pipelines.tasks.finetune import RUN_FILE, FinetuneConfig, FinetuneTask
from storage import FeatureReader

log = logging.getLogger(__name__)

CAPTION_INPUTS = ("input_ids", "visual_feats", "visual_pos", "visual_attention_mask")
TINY_VOCAB_UNKNOWN = 0.1  # above this share of <unk> training words, a built vocabulary is too small


def scheduled_sampling_prob(cfg: FinetuneConfig, epoch: int) -> float:
    """self-critical.pytorch's ss_prob: increase x ((epoch - start) // every), at most the maximum."""
    start = cfg.scheduled_sampling_start
    if start is None or epoch < start:
        return 0.0
    steps = (epoch - start) // cfg.scheduled_sampling_every
    return min(cfg.scheduled_sampling_increase * steps, cfg.scheduled_sampling_max)


def references(examples: Iterable[CaptionExample]) -> dict[int, list[str]]:
    """Tokenised reference strings by image id, the form CIDEr-D and the Python metrics take."""
    return {e.image_id: [" ".join(c) for c in e.label] for e in examples if e.label}


def ids_text(ids: Iterable[int]) -> str:
    """Word ids as the space-separated string self-critical.pytorch's `array_to_str` scores."""
    return " ".join(str(i) for i in ids)


def until_eos(tokens: Sequence[int], eos_id: int) -> list[int]:
    """A decoded row up to and with its first `<eos>` (the whole row when there is none)."""
    return list(tokens[: tokens.index(eos_id) + 1]) if eos_id in tokens else list(tokens)


def self_critical_cider(examples: Iterable[CaptionExample], vocab: Vocabulary, max_length: int) -> CiderD:
    """self-critical.pytorch's SCST reward scorer over word ids: each image's references truncated to
    `max_length` words with rare words as `<unk>` and `<eos>` after those that fit (its label arrays), and
    document frequencies over the whole references with `<eos>` (prepro_ngrams.py's corpus)."""
    truncated: dict[int, list[str]] = {}
    whole: dict[int, list[str]] = {}
    for e in examples:
        if not e.label:
            continue
        truncated[e.image_id] = [
            ids_text(until_eos(vocab.encode(c, max_length)[1:], vocab.eos_id)[:max_length]) for c in e.label
        ]
        whole[e.image_id] = [ids_text(vocab.encode(c, len(c))[1:]) for c in e.label]
    return CiderD(truncated, document_frequencies=whole)


def _caption_scores(predictions: dict, examples: Sequence[CaptionExample], java: bool) -> CaptionScores:
    """The COCO caption metrics of validation (`java=False`: Python metrics on the tokenised references)
    and of `xmodal evaluate` / `score` (raw references through pycocoevalcap's tokenizer)."""
    labelled = {e.image_id: e for e in examples if e.label}
    if java:
        refs = {k: list(e.raw) or [" ".join(c) for c in e.label] for k, e in labelled.items()}
    else:
        refs = references(labelled.values())
    return evaluate_captions(refs, {k: predictions[k] for k in labelled}, pretokenized=not java, java=java)


def own_validation(train_files: Sequence[str]) -> list[str]:
    """Without --valid, the validation split the training files bring, as LAVIS and self-critical.pytorch
    validate on Karpathy's `val`: `FILE:val` of a file given without `:SPLIT` that holds `val` images, and
    COCO's `captions_valYYYY.json` beside a `captions_trainYYYY.json`."""
    found = []
    for spec in train_files:
        path, split = split_spec(spec, None)
        coco_val = path.with_name(path.name.replace("captions_train", "captions_val", 1))
        if split is None and path.name.startswith("captions_train") and coco_val.is_file():
            found.append(str(coco_val))
        elif split is None and any(im.split == "val" for im in read_caption_file(path)):
            found.append(f"{path}{SPLIT_SEPARATOR}val")
    if found:
        log.info("validating on %s (the training files' own split; --valid picks another)", ", ".join(found))
    return found


SCST_REWARDS = ("cider-d", "self-critical")

# self-critical.pytorch's vocabulary and decoding, common to its two phases. scripts/prepro_labels.py keeps
# words seen more than 5 times (`n > count_thr`, --word_count_threshold 5) in all of dataset_coco.json,
# every split. train.py validates every save_checkpoint_every (3000) iterations with opts.py's sampling
# defaults: beam_size 1, that is AttModel._sample's greedy decoding, which leaves <unk> alone (only
# CaptionModel.beam_search subtracts 1000), up to max_length 20 words; its test decodes beam 5
# (`eval.py --beam_size 5`), <unk> -1000.
_SELF_CRITICAL_DATA = {
    "vocab_min_count": 6,
    "vocab_from": "all",
    "beam_size": 1,
    "unk_penalty": 0.0,
    "decode_max_length": 20,
    "test_beam_size": 5,
    "test_unk_penalty": 1000.0,
}

# Named settings (`xmodal finetune caption --recipe NAME`): (task fields, train fields) over the defaults.
RECIPES: dict[str, tuple[dict, dict]] = {
    # xmodal's defaults, chosen for small data: one reference per image and batches of 32 images, the
    # global gradient norm clipped at 0.1, linear decay, no scheduled sampling, <unk> kept out of decoding
    "xmodal": ({}, {}),
    # self-critical.pytorch's Up-Down cross-entropy recipe (opts.py defaults and configs/updown.yml): raw
    # features, 10 images x 5 references per batch, Adam lr 5e-4 x0.8 every 3 epochs, every gradient value
    # clipped at 0.1, scheduled sampling +0.05 every 5 epochs up to 0.25, 30 epochs.
    "self-critical-updown": (
        {
            "model": {"normalize_features": False},
            "captions_per_image": 5,
            "scheduled_sampling_start": 0,
            "scheduled_sampling_every": 5,
            "scheduled_sampling_increase": 0.05,
            "scheduled_sampling_max": 0.25,
            **_SELF_CRITICAL_DATA,
        },
        {
            "batch_size": 10,
            "lr": 5e-4,
            "schedule": "epochs",
            "lr_decay_epochs": 3,
            "lr_gamma": 0.8,
            "clip_norm": None,
            "clip_value": 0.1,
            "eval_every": 3000,
        },
    ),
    # its SCST phase (configs/updown_sc.yml over updown.yml): --start_from the cross-entropy run's weights
    # and Adam state (--init RUN/last, task.init_optimizer), 20 more epochs (30 -> 50) at lr 5e-5 without
    # decay, 5 samples per image against the greedy caption (with <unk> allowed), its reward on word ids
    "self-critical-updown-scst": (
        {
            "model": {"normalize_features": False},
            "init_optimizer": True,
            "scst_from_epoch": 0,
            "scst_samples": 5,
            "scst_reward": "self-critical",
            "scst_suppress_unk": False,
            **_SELF_CRITICAL_DATA,
        },
        {
            "batch_size": 10,
            "lr": 5e-5,
            "epochs": 20,
            "schedule": "epochs",
            "lr_gamma": 1.0,
            "clip_norm": None,
            "clip_value": 0.1,
            "eval_every": 3000,
        },
    ),
}


class CaptionTask(FinetuneTask):
    """A caption per image; `task.scst_from_epoch` switches cross-entropy to self-critical training."""

    name = "caption"
    role = "caption"
    lr = 5e-4  # self-critical.pytorch's cross-entropy rate; SCST runs take 5e-5 (README)
    example_noun = "images"
    primary_metric = "CIDEr"
    recipes = tuple(RECIPES)

    def __init__(
        self, cfg: FinetuneConfig, answers: Vocabulary | None = None, cache_dir: str | Path | None = None
    ) -> None:
        if cfg.task != self.name:
            raise ValueError(f"a {cfg.task} config given to the {self.name} task")
        if not cfg.features:
            raise ValueError("no feature store given: pass --features feats.lmdb")
        if not cfg.train_files:
            raise ValueError("no training file given: pass --train dataset_coco.json (Karpathy split)")
        self.config = cfg
        self.token_cache = Path(cache_dir) if cache_dir is not None else None
        self.family = get_family(cfg.arch)
        if self.role not in self.family.models:
            captioners = sorted(name for name, f in FAMILIES.items() if self.role in f.models)
            raise ValueError(f"--arch {cfg.arch} is not a captioner; choose one of {captioners}")
        self.features = StoreImages(FeatureReader(cfg.features))
        self.train_examples = self._load_split(cfg.train_files, "train", "training data")
        valid_files = cfg.valid_files or own_validation(cfg.train_files)
        self.valid_examples = self._load_split(valid_files, "val", "validation data") if valid_files else []
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
        if cfg.vocab_from not in ("train", "all"):
            raise ValueError(f"task.vocab_from {cfg.vocab_from!r}: choose train or all")
        if cfg.scst_reward not in SCST_REWARDS:
            raise ValueError(f"task.scst_reward {cfg.scst_reward!r}: choose one of {', '.join(SCST_REWARDS)}")
        if cfg.captions_per_image < 1 or cfg.scst_samples < 1:
            raise ValueError("task.captions_per_image and task.scst_samples must be at least 1")
        # SCST rewards: CIDEr-D with document frequencies from the training references (on words, or on
        # word ids as self-critical.pytorch scores them).
        if cfg.scst_reward == "self-critical":
            self.cider = self_critical_cider(self.train_examples, self.vocab, cfg.max_length)
        else:
            self.cider = CiderD(references(self.train_examples))
        self.self_critical = False
        self.sampling_prob = 0.0

    # ---- setup
    def _load_split(self, files: Sequence[str], split: str, what: str) -> CaptionRows:
        examples = load_caption_rows(files, split, self.token_cache)
        present = np.array([n in self.features for n in examples.image_names], dtype=bool)
        missing = np.nonzero(~present[examples.image_indices()[:, 0]])[0]
        if len(missing) and self.config.skip_missing:
            log.warning("%s: skipped %d images not in the store", what, len(missing))
            examples = examples.select_images(present)
        elif len(missing):
            raise ValueError(
                f"{what} ({', '.join(files)}): {len(missing)} images are not in the feature store "
                f"(e.g. {examples.image_ids(missing[:5])}); extract them or pass --skip-missing"
            )
        if not examples:
            raise ValueError(f"{what} ({', '.join(files)}) holds no usable image")
        return examples

    @classmethod
    def text_vocabulary(cls, cfg: FinetuneConfig) -> Vocabulary | None:
        """The word list of `--vocab` (a vocab.txt of one word per line, as `xmodal vocab build` writes, or
        a caption run's vocab.json) or of the init directory; None: built from the training captions."""
        path = cfg.vocab or (str(Path(cfg.init) / VOCAB_FILE) if cfg.init else None)
        if path and not cfg.vocab and not Path(path).is_file():
            what = "does not exist" if not Path(cfg.init).exists() else f"has no {VOCAB_FILE}"
            raise ValueError(
                f"--init {cfg.init} {what}: it is not a captioning run's directory; give one written by "
                "`xmodal finetune caption` (its best/ or last/)"
            )
        if cfg.vocab and not Path(cfg.vocab).exists():
            raise ValueError(
                f"--vocab {cfg.vocab}: no such file; a captioner takes a word list (a vocab.txt, e.g. from "
                "`xmodal vocab build captions.json --out vocab.txt`, or a caption run's vocab.json), "
                "not a hub id"
            )
        try:
            return Vocabulary.load(path) if path else None
        except ValueError as exc:
            if not cfg.vocab:
                raise
            raise ValueError(
                f"--vocab: {exc}; a captioner takes a vocab.txt of one word per line or a caption run's "
                "vocab.json"
            ) from None

    def _vocabulary(self) -> Vocabulary:
        cfg = self.config
        given = self.text_vocabulary(cfg)
        if given is not None:
            return given
        captions = [c for e in self.train_examples for c in e.label]
        counted = captions
        if cfg.vocab_from == "all":  # every split of the training files, as prepro_labels.py
            paths = dict.fromkeys(split_spec(spec, None)[0] for spec in cfg.train_files)
            counted = [c for path in paths for image in read_caption_file(path) for c in image.captions]
        vocab = Vocabulary.build(counted, cfg.vocab_min_count)
        log.info("vocabulary: %d words seen at least %d times in %d %s captions",
                 len(vocab) - 4, cfg.vocab_min_count, len(counted),
                 "training" if counted is captions else "(all splits)")  # fmt: skip
        words = [w for c in captions for w in c]
        unknown = sum(w not in vocab.index for w in words) / max(len(words), 1)
        if unknown > TINY_VOCAB_UNKNOWN:
            log.warning(
                "the caption vocabulary has only %d words (those seen at least %d times in %d training "
                "captions): %.0f%% of the captions' words become <unk>; pass --vocab vocab.txt (`xmodal "
                "vocab build CAPTIONS --out vocab.txt`) or lower the count (task.vocab_min_count=1)",
                len(vocab) - 4, cfg.vocab_min_count, len(captions), 100 * unknown,
            )  # fmt: skip
        return vocab

    @classmethod
    def default_train_config(cls) -> TrainConfig:
        """The `xmodal` recipe: Adam lr 5e-4 without weight decay or warm-up, 30 epochs, as
        self-critical.pytorch; for small data, batches of 32 images, the global gradient norm clipped at 0.1
        and linear decay (`--recipe self-critical-updown` is that repository's recipe exactly)."""
        return TrainConfig(
            lr=cls.lr, batch_size=32, epochs=30, warmup_ratio=0.0, clip_norm=0.1, weight_decay=0.0
        )

    @classmethod
    def recipe(cls, name: str) -> tuple[FinetuneConfig, TrainConfig]:
        """The task and train settings of recipe `name` (RECIPES) over the defaults."""
        if name not in RECIPES:
            raise ValueError(f"recipe {name!r}: choose one of {', '.join(RECIPES)}")
        task, train = RECIPES[name]
        return replace(cls.default_config(), **task), replace(cls.default_train_config(), **train)

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
        return CaptionDataset(examples, features, tokenizer, max_length, cache_dir)

    @staticmethod
    def collate_items(items: list[dict], pad_id: int = 0) -> dict:
        return collate_captions(items, None, pad_id)

    def collate(self, items: list, rng: np.random.Generator) -> dict:
        return collate_captions(items, rng, self.vocab.pad_id, self.config.captions_per_image)

    # ---- training
    def set_epoch(self, epoch: int) -> None:
        start = self.config.scst_from_epoch
        switched = start is not None and epoch >= start
        if switched and not self.self_critical:
            log.info("epoch %d: self-critical training (CIDEr-D reward, greedy baseline) from here on", epoch)
        self.self_critical = switched
        self.sampling_prob = scheduled_sampling_prob(self.config, epoch)

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        if not self.self_critical:
            inputs = float_inputs({k: batch[k] for k in CAPTION_INPUTS})
            rows = batch.get("caption_rows")
            if rows is not None:  # several references per image: each caption row reads its image
                for k in ("visual_feats", "visual_pos", "visual_attention_mask"):
                    inputs[k] = inputs[k].index_select(0, rows)
            out = model(**inputs, labels=batch["labels"], scheduled_sampling=self.sampling_prob)
            return out.loss, {"ss_prob": self.sampling_prob} if self.sampling_prob else {}
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError("self-critical training runs in one process: set train.workers=0")
        out = self_critical_loss(
            model,
            batch["visual_feats"].float(),
            batch["visual_attention_mask"],
            self.reward(batch["ids"]),
            samples_per_image=self.config.scst_samples,
            suppress_unk=self.config.scst_suppress_unk,
            max_length=self.config.decode_max_length,  # as long as validation decodes
        )
        return out.loss, {
            "reward": float(out.sample_reward.mean()),
            "greedy_reward": float(out.greedy_reward.mean()),
        }

    def reward(self, ids: Sequence) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """SCST's reward of decoded rows (R, L) of the batch's images `ids` (the row's image in `rows`)."""

        def reward(tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            if self.config.scst_reward == "self-critical":
                captions = [ids_text(until_eos(t, self.vocab.eos_id)) for t in tokens.tolist()]
            else:
                captions = [self.vocab.decode(t) for t in tokens.tolist()]
            scores = self.cider.scores((ids[r], c) for r, c in zip(rows.tolist(), captions, strict=True))
            return torch.from_numpy(scores)

        return reward

    def evaluate(self, model: torch.nn.Module, loader: Iterable[dict]) -> dict[str, float]:
        cfg = self.config
        predictions, _ = self.predict(
            model,
            loader,
            self.vocab,
            cfg.beam_size,
            unk_penalty=cfg.unk_penalty,
            max_length=cfg.decode_max_length,
        )
        return self.score(predictions, self.valid_examples, java=False)

    # ---- predictions and scores
    @classmethod
    @torch.no_grad()
    def predict(
        cls,
        model: torch.nn.Module,
        batches: Iterable[dict],
        answers: Vocabulary,
        beam_size: int = 3,
        unk_penalty: float | None = None,
        max_length: int | None = None,
    ) -> tuple[dict, float | None]:
        """The best beam's caption by image id (no loss: captions are generated, not teacher-forced), of
        at most `max_length` words (None: the model's)."""
        was_training = model.training
        model.eval()
        predictions: dict = {}
        for batch in batches:
            beams = beam_search(
                model,
                batch["visual_feats"].float(),
                batch["visual_attention_mask"],
                beam_size,
                max_length=max_length,
                unk_penalty=unk_penalty,
            )
            predictions.update(
                zip(batch["ids"], (answers.decode(t) for t in beams.best.tolist()), strict=True)
            )
        model.train(was_training)
        return predictions, None

    @staticmethod
    def score(predictions: dict, examples: Sequence[CaptionExample], java: bool = True) -> dict[str, float]:
        """COCO caption metrics ×100 (pycocoevalcap names) of the predictions against raw references."""
        scores = _caption_scores(predictions, examples, java)
        for name, reason in scores.skipped.items() if java else ():  # validation skips Java on purpose
            log.warning("%s skipped: %s", name, reason)
        return {name: 100.0 * value for name, value in scores.metrics.items()}

    @staticmethod
    def describe(example: CaptionExample) -> dict:
        return {"image_id": example.image_id, "image": example.img_id, "references": list(example.raw)}

    @staticmethod
    def score_files(
        predictions: str | Path,
        gold: str | Path,
        questions: str | Path | None = None,
        evaluator: str | None = None,
    ) -> dict:
        """COCO caption metrics of a COCO results file against references (`FILE[:SPLIT]`: a COCO
        captions_*.json or Karpathy's split file), through the same code as `xmodal evaluate caption`. As
        the COCO evaluation, the predicted images are scored; each must have references."""
        if questions is not None:
            raise ScoringInputError(
                f"{questions}: captioning has no questions file; the references are the gold"
            )
        results = read_caption_results(predictions)
        examples = {e.image_id: e for e in load_caption_examples(gold) if e.label}
        unknown = [i for i in results if i not in examples]
        if unknown:
            raise ScoringInputError(
                f"{len(unknown)} captioned images have no references in {gold} (e.g. {unknown[0]}): "
                "score against the references of the split that was captioned"
            )
        scores = _caption_scores(results, [examples[i] for i in results], java=True)
        return {
            **{name: 100.0 * value for name, value in scores.metrics.items()},
            "images": len(results),
            "skipped": scores.skipped,
        }

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
            "unk_penalty": self.config.unk_penalty,
            "decode_max_length": self.config.decode_max_length,
            "test_beam_size": self.config.test_beam_size,
            "test_unk_penalty": self.config.test_unk_penalty,
            "vocab": VOCAB_FILE,
            "init": self.config.init,
            "features": list(self.config.features),
            "feature_dim": self.features.feature_dim,
            "detector": self.features.meta.get("provenance", {}),
        }
        (directory / RUN_FILE).write_text(json.dumps(settings, indent=2) + "\n")
