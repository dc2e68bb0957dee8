"""DALL-E's transformer as an engine task: (caption, token grid) pairs from a captions file and an image-token
store; the run's checkpoints are self-contained (transformer, caption vocabulary, and the dVAE to decode)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from model.dalle import DalleConfig, DalleTransformer, DiscreteVAE
from pipelines.data.captions import CaptionImage, Vocabulary, read_karpathy_split, tokenize_caption
from pipelines.engine import config_io
from pipelines.engine.trainer import TrainConfig
from pipelines.tasks.generation import load_tokenizer
from storage.token_store import TokenReader

log = logging.getLogger(__name__)

PRIMARY_METRIC = "image_log_likelihood"  # minus the mean image-token cross-entropy (nats): higher is better
# the same with every image paired with another image's caption: below PRIMARY_METRIC when the text is used
SHUFFLED_METRIC = "image_log_likelihood_shuffled_captions"
VOCAB_FILE = "caption_vocab.json"
DVAE_DIR = "dvae"


@dataclass
class TextToImageTaskConfig:
    """What the transformer trains on: a token store, a Karpathy-style captions file, and the tokenizer run
    whose dVAE made the store (copied into every checkpoint so sampling can decode)."""

    RANGES: ClassVar[dict[str, str]] = {"min_word_count": "[1, 1000000000]", "caption_dropout": "[0, 1)"}

    features: str = ""
    captions: str = ""
    tokenizer: str = ""
    preset: str = "small"
    dalle: dict[str, Any] = field(default_factory=dict)
    min_word_count: int = 1  # caption words seen fewer times map to <unk>
    # The fraction of training pairs whose caption is replaced by the empty one (`<bos> <eos>`, then
    # padding), so the model also learns p(image) and can sample with classifier-free guidance
    # (`xmodal generate --guidance`); 0: every pair keeps its caption (the paper's).
    caption_dropout: float = 0.0

    def __post_init__(self) -> None:
        # `task.dalle` overrides meet DalleConfig's types and ranges when the run's config is resolved
        config_io.check_mapping_field((DalleConfig,), self.dalle, "task.dalle")


def default_train_config(preset: str) -> TrainConfig:
    """The small preset: AdamW at 1e-3 on 32 pairs per step (a few minutes on 2 CPU cores); the paper's
    Adam at 4.5e-4 on batches of 1024 is its configuration."""
    if preset == "small":
        return TrainConfig(
            lr=1e-3,
            batch_size=32,
            max_steps=800,
            warmup_ratio=0.05,
            weight_decay=0.01,
            trackers=[],
            eval_every=200,
            log_every=50,
            loader_workers=0,
        )
    return TrainConfig(lr=4.5e-4, batch_size=1024, max_steps=430_000, weight_decay=0.01, warmup_ratio=0.01)


@dataclass
class TextToImageRun:
    """The whole run as written to config.yaml: `train.*` and `task.*` keys."""

    train: TrainConfig = field(default_factory=lambda: default_train_config("small"))
    task: TextToImageTaskConfig = field(default_factory=TextToImageTaskConfig)


def encode_prompt(vocab: Vocabulary, text: str, text_length: int) -> tuple[np.ndarray, np.ndarray]:
    """`<bos> words <eos>` ids in `text_length` positions and the mask of the padding positions."""
    ids = vocab.encode(tokenize_caption(text), max_length=text_length - 2)
    out = np.zeros(text_length, dtype=np.int64)
    out[: len(ids)] = ids
    padding = np.arange(text_length) >= len(ids)
    return out, padding


class CaptionTokenPairs(Dataset):
    """Every (caption, token grid) pair of the images of one split found in the store."""

    def __init__(
        self,
        images: list[CaptionImage],
        store: TokenReader,
        vocab: Vocabulary,
        text_length: int,
        caption_dropout: float = 0.0,
    ):
        self.store_path, self.vocab, self.text_length = store.path, vocab, text_length
        self.caption_dropout = caption_dropout  # the training pairs' (collate drops); validation keeps all
        self.grids = {Path(im.filename).stem: store[Path(im.filename).stem].reshape(-1) for im in images}
        self.pairs = [(Path(im.filename).stem, raw) for im in images for raw in im.raw]

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """(caption ids, padding mask, token grid, the probability that collate drops the caption)"""
        img_id, caption = self.pairs[i]
        text, padding = encode_prompt(self.vocab, caption, self.text_length)
        return text, padding, self.grids[img_id], self.caption_dropout


class TextToImageTask:
    """The Task the engine trains (see pipelines.engine.trainer.Task)."""

    primary_metric = PRIMARY_METRIC

    def __init__(self, cfg: TextToImageTaskConfig) -> None:
        self.config = cfg
        for name in ("features", "captions", "tokenizer"):
            if not getattr(cfg, name):
                raise ValueError(f"--{name} is required (or task.{name} in --config)")
        self.dvae: DiscreteVAE = load_tokenizer(cfg.tokenizer)
        store = TokenReader(cfg.features)
        grid, codes = self.dvae.config.grid_size, self.dvae.config.codebook_size
        if (store.grid, store.codebook_size) != (grid, codes):
            raise ValueError(
                f"{cfg.features} holds {store.grid} x {store.grid} grids of {store.codebook_size} codes but "
                f"the tokenizer {cfg.tokenizer} makes {grid} x {grid} of {codes}: tokenize with it"
            )
        images = read_karpathy_split(cfg.captions)
        present = [im for im in images if Path(im.filename).stem in store]
        if len(present) < len(images):
            log.warning(
                "%d of %d captioned images are not in %s; training without them",
                len(images) - len(present),
                len(images),
                cfg.features,
            )
        train = [im for im in present if im.split == "train"]
        if not train:
            raise ValueError(
                f"{cfg.captions}: none of its training images is in {cfg.features}; tokenize their folder"
            )
        self.vocab = Vocabulary.build((c for im in train for c in im.captions), cfg.min_word_count)
        self.dalle_config = DalleConfig.preset(
            cfg.preset,
            **{
                "image_grid": grid,
                "image_vocab_size": codes,
                **cfg.dalle,
                "text_vocab_size": len(self.vocab),
            },
        )
        t = self.dalle_config.text_length
        self._train = CaptionTokenPairs(train, store, self.vocab, t, cfg.caption_dropout)
        valid = [im for im in present if im.split == "val"]
        self._valid = CaptionTokenPairs(valid, store, self.vocab, t) if valid else None
        store.close()
        log.info(
            "text-to-image: %d training pairs, %d validation pairs, %d caption words",
            len(self._train),
            len(self._valid) if self._valid else 0,
            len(self.vocab),
        )

    def build_model(self) -> nn.Module:
        return DalleTransformer(self.dalle_config)

    def train_dataset(self) -> Dataset:
        return self._train

    def valid_dataset(self) -> Dataset | None:
        return self._valid

    def collate(self, items: list, rng: np.random.Generator) -> dict:
        columns = list(zip(*items, strict=True))
        text, padding, image = (torch.from_numpy(np.stack(column)) for column in columns[:3])
        dropout = np.asarray(columns[3], dtype=np.float64)
        if dropout.any():
            dropped = torch.from_numpy(rng.random(len(items)) < dropout)
            empty_text, empty_padding = (
                torch.from_numpy(a) for a in encode_prompt(self.vocab, "", text.shape[1])
            )
            text = torch.where(dropped[:, None], empty_text, text)
            padding = torch.where(dropped[:, None], empty_padding, padding)
        return {"text": text, "padding": padding, "image": image}

    def loss(self, model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        transformer = _unwrap(model)
        out = transformer.loss(transformer.pad_text(batch["text"], batch["padding"]), batch["image"])
        return out.loss, {"text_loss": out.text.detach(), "image_loss": out.image.detach()}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader) -> dict[str, float]:
        transformer = _unwrap(model)
        total, shuffled, count, pairs = 0.0, 0.0, 0, 0
        for b in loader:
            text = transformer.pad_text(b["text"], b["padding"])
            out = transformer.loss(text, b["image"])
            total += float(out.image) * len(b["image"])
            count += len(b["image"])
            if len(b["image"]) > 1:
                # each image after the batch's next caption: how much the caption tells about the image
                shuffled += float(transformer.loss(text.roll(1, 0), b["image"]).image) * len(b["image"])
                pairs += len(b["image"])
        if not count:
            return {}
        metrics = {PRIMARY_METRIC: -total / count}
        if pairs:
            metrics[SHUFFLED_METRIC] = -shuffled / pairs
        return metrics

    def save(self, model: nn.Module, directory: Path) -> None:
        _unwrap(model).save_pretrained(directory)
        self.vocab.save(directory / VOCAB_FILE)
        if not (directory / DVAE_DIR).is_dir():
            self.dvae.save_pretrained(directory / DVAE_DIR)


def _unwrap(model: nn.Module) -> DalleTransformer:
    return getattr(model, "module", model)


@dataclass
class TextToImageModel:
    """A trained checkpoint: the transformer, its caption vocabulary and the dVAE that decodes its tokens."""

    transformer: DalleTransformer
    vocab: Vocabulary
    dvae: DiscreteVAE

    @classmethod
    def load(cls, path: str | Path) -> TextToImageModel:
        """From a `generate train` run (its best/, else last/) or one checkpoint directory."""
        path = Path(path)
        for candidate in (path / "best", path / "last", path):
            if (candidate / VOCAB_FILE).is_file():
                return cls(
                    DalleTransformer.from_pretrained(candidate).eval(),
                    Vocabulary.load(candidate / VOCAB_FILE),
                    DiscreteVAE.from_pretrained(candidate / DVAE_DIR).eval(),
                )
        raise ValueError(f"{path}: not a `xmodal generate train` run or checkpoint (no {VOCAB_FILE})")
