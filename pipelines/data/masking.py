"""Pre-training collation: masked tokens, masked objects or regions, mismatched sentences, QA answers.

Runs in DataLoader workers on a whole micro-batch at once (`PretrainBatch`), every draw vectorised over
the batch and taken from the `rng` handed in, in a fixed order (mismatches, tokens, objects, answers), so
a batch is a pure function of its examples and its seed. Validation batches (`evaluation`) also get the
questions' clean inputs and the soft score of each of their answers in the table, for the QA accuracy.
Region features stay in the store's dtype and unmasked: the task widens them on the device and applies the
object masking drawn here (`apply_object_masking`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch

from pipelines.data.corpus import PretrainCorpus, corpus_texts
from pipelines.data.pretrain import PretrainBatch, PretrainExample
from pipelines.data.regions import IMAGE_SIZE, image_sizes, normalized_batch_boxes
from pipelines.data.text import EncodedTexts

MISMATCH_TRIES = 10  # draws for a sentence of another image before the pair stays matched (the release's)


def _pair_keys(images: np.ndarray, sentence_hashes: np.ndarray) -> np.ndarray:
    """One int64 per (image code, sentence hash) pair (wrapping arithmetic; a clash is ~2^-64 likely)."""
    with np.errstate(over="ignore"):
        return sentence_hashes * np.int64(0x9E3779B97F4A7C15 - (1 << 64)) + images


def _held(keys: np.ndarray, held: np.ndarray) -> np.ndarray:
    """Whether each of `keys` is in the sorted unique `held` (a binary search each: `np.isin` would sort
    all of `held`, millions of pairs, for every batch)."""
    if not len(held):
        return np.zeros(keys.shape, dtype=bool)
    at = np.minimum(np.searchsorted(held, keys), len(held) - 1)
    return held[at] == keys


def mask_tokens(
    ids: np.ndarray,
    maskable: np.ndarray,
    rng: np.random.Generator,
    vocab_size: int,
    mask_id: int,
    prob: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Pick each maskable token with `prob`: 80% [MASK], 10% a random token, 10% kept.
    Returns (new ids, labels: the original id where picked, -100 elsewhere)."""
    picked = (rng.random(ids.shape) < prob) & maskable
    fate = rng.random(ids.shape)
    out = ids.copy()
    out[picked & (fate < 0.8)] = mask_id
    swap = picked & (fate >= 0.8) & (fate < 0.9)
    out[swap] = rng.integers(0, vocab_size, size=int(swap.sum()))
    return out, np.where(picked, ids, -100)


def mask_words(
    ids: np.ndarray,
    maskable: np.ndarray,
    continues: np.ndarray,
    rng: np.random.Generator,
    vocab_size: int,
    mask_id: int,
    prob: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Whole-word masking: pick each maskable word (a piece and the `continues` pieces after it, "##...")
    with `prob`; all its pieces then become [MASK] (80%), random tokens (10%) or stay (10%), one fate per
    word. Returns (new ids, labels: the original id where picked, -100 elsewhere)."""
    word = np.cumsum(~continues, axis=1)  # word index of each piece within its row
    word_picked = rng.random(ids.shape) < prob  # drawn per word start, read through `word`
    word_fate = rng.random(ids.shape)
    starts = np.argmax(word[:, :, None] == word[:, None, :], axis=2)  # first piece of each piece's word
    rows = np.arange(ids.shape[0])[:, None]
    picked = word_picked[rows, starts] & maskable
    fate = word_fate[rows, starts]
    out = ids.copy()
    out[picked & (fate < 0.8)] = mask_id
    swap = picked & (fate >= 0.8) & (fate < 0.9)
    out[swap] = rng.integers(0, vocab_size, size=int(swap.sum()))
    return out, np.where(picked, ids, -100)


def draw_object_masking(
    valid: np.ndarray,
    group: np.ndarray,
    rng: np.random.Generator,
    prob: float,
    zero: float = 0.8,
    swap: float = 0.1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The draws of `mask_objects`, without touching features: (picked, zeroed, source) (B, N), where
    `source` is the flat index (row * N + slot) of the object lent to a swapped one, else -1."""
    picked = (rng.random(valid.shape) < prob) & valid
    fate = rng.random(valid.shape)
    zeroed = picked & (fate < zero)
    source = np.full(valid.shape, -1, dtype=np.int64)
    rows, slots = np.nonzero(picked & (fate >= zero) & (fate < zero + swap))
    if rows.size:
        u = rng.random((rows.size, 2))
        donors = (group[None, :] != group[:, None]) & valid.any(axis=1)[None, :]  # (B, B): row may lend
        eligible = donors[rows]
        count = eligible.sum(axis=1)
        # the k-th eligible row, k uniform; a batch of one image has no donor: the feature stays
        k = np.minimum((u[:, 0] * count).astype(np.int64), np.maximum(count - 1, 0))
        donor = np.argmax(np.cumsum(eligible, axis=1) > k[:, None], axis=1)
        real = valid[donor]
        n_real = real.sum(axis=1)
        s = np.minimum((u[:, 1] * n_real).astype(np.int64), np.maximum(n_real - 1, 0))
        slot = np.argmax(np.cumsum(real, axis=1) > s[:, None], axis=1)
        ok = count > 0
        source[rows[ok], slots[ok]] = donor[ok] * valid.shape[1] + slot[ok]
    return picked, zeroed, source


def mask_objects(
    feats: np.ndarray,
    valid: np.ndarray,
    group: np.ndarray,
    rng: np.random.Generator,
    prob: float,
    zero: float = 0.8,
    swap: float = 0.1,
) -> tuple[np.ndarray, np.ndarray]:
    """Pick each real object (B, N) with `prob`: a share `zero` of them zeroed, `swap` given the feature of
    a random object of another image of the batch (`group` = image of each row; the image row and its
    object each uniform), the rest kept (LXMERT: 80/10/10, ViLBERT: 90/0/10). Returns (new features,
    picked)."""
    picked, zeroed, source = draw_object_masking(valid, group, rng, prob, zero, swap)
    out = torch.from_numpy(feats.copy())
    _apply(out, torch.from_numpy(feats), torch.from_numpy(zeroed), torch.from_numpy(source))
    return out.numpy(), picked


def _apply(out: torch.Tensor, feats: torch.Tensor, zeroed: torch.Tensor, source: torch.Tensor) -> None:
    """Zero the `zeroed` objects of `out` and give the swapped ones their lent feature from `feats`."""
    out[zeroed] = 0
    lent = source >= 0
    out[lent] = feats.reshape(-1, feats.shape[-1])[source[lent]]


def apply_object_masking(batch: dict) -> dict:
    """`batch` with the collator's object-masking draws applied where the batch is (the device): the
    stored features become `feat_targets` (when that objective is on) and, masked, `visual_feats`.
    The loader sends the features once and unmasked: half the bytes, and no copy in the worker."""
    if "object_zeroed" not in batch:
        return batch
    batch = dict(batch)
    feats = batch["visual_feats"]
    zeroed, source = batch.pop("object_zeroed"), batch.pop("object_source")
    if "feat_weights" in batch:
        batch["feat_targets"] = feats
    masked = feats.clone()
    _apply(masked, feats, zeroed, source)
    batch["visual_feats"] = masked
    return batch


def sample_answers(labels: np.ndarray, scores: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(B,) one answer label per row of (B, K) `labels` (-100 pads), drawn with probability proportional
    to its soft score (uniformly when a row's scores sum to 0); -100 for a row without answers."""
    u = rng.random(labels.shape[0])
    real = labels != -100
    weights = np.where(real, np.maximum(scores, 0.0), 0.0).astype(np.float64)
    total = weights.sum(axis=1)
    weights = np.where((total > 0)[:, None], weights, real.astype(np.float64))
    cum = np.cumsum(weights, axis=1)
    count = real.sum(axis=1)
    pick = (cum <= (u * cum[:, -1])[:, None]).sum(axis=1)  # first answer whose cumulative share passes u
    pick = np.minimum(pick, np.maximum(count - 1, 0))
    chosen = labels[np.arange(labels.shape[0]), pick]
    return np.where(count > 0, chosen, -100)


@dataclass
class MaskingConfig:
    """Which pre-training tasks get labels, and the release's probabilities."""

    RANGES: ClassVar[dict[str, str]] = {
        "mlm_prob": "[0, 1]",
        "object_prob": "[0, 1]",
        "object_zero": "[0, 1]",
        "object_swap": "[0, 1]",
        "mismatch_prob": "[0, 1]",
        "max_seq_len": "[3, 65536]",
    }

    mlm: bool = True
    matched: bool = True
    obj: bool = True
    attr: bool = True
    feat: bool = True
    qa: bool = True
    # masked-region classification (ViLBERT): the detector's class distribution of each masked region, or
    # its top class weighted by confidence where the store has no distribution
    regions: bool = True
    mlm_prob: float = 0.15
    object_prob: float = 0.15
    # shares of the masked objects zeroed and swapped for another image's, the rest kept; None = the
    # model's own rule (its pre-training class's REGION_MASKING), else LXMERT's 0.8 / 0.1
    object_zero: float | None = None
    object_swap: float | None = None
    mismatch_prob: float = 0.5
    max_seq_len: int = 20
    # the release weights label losses by detector confidence on all objects; "masked" only on picked ones
    object_loss_on: Literal["all", "masked"] = "all"
    # mask a word's WordPiece pieces together (VL-BERT's recipe); None = the model's own rule
    whole_words: bool | None = None


class PretrainCollator:
    """(PretrainBatch or a list of them, rng) -> the model's inputs and labels, regions padded to the
    set's max boxes.

    Mismatched sentences come from `examples` (the training set; `texts` their token ids, tokenised here
    when not given). With QA on, `qa_active` (the task's QA schedule) and a validation batch, `qa_eval`
    holds every question of the batch, matched to its own image and unmasked, as model inputs;
    `qa_eval_answers` / `qa_eval_scores` (Q, K) its answers' labels (-100 pads) and soft scores;
    `qa_eval_sources` its `sentf` source names."""

    def __init__(
        self,
        tokenizer,
        examples: PretrainCorpus | list[PretrainExample],
        max_boxes: int,
        cfg: MaskingConfig,
        texts: EncodedTexts | None = None,
        held: PretrainCorpus | Sequence[PretrainExample] = (),
    ):
        self.cfg = cfg
        self.max_boxes = max_boxes
        pool = examples if isinstance(examples, PretrainCorpus) else PretrainCorpus.from_examples(examples)
        if texts is None:
            texts = (
                corpus_texts(pool, tokenizer, cfg.max_seq_len, None)
                if isinstance(examples, PretrainCorpus)
                else EncodedTexts(tokenizer, [e.sentence for e in examples], cfg.max_seq_len)
            )
        self.texts = texts
        if len(self.texts) != len(pool):
            raise ValueError(f"{len(self.texts)} tokenised sentences for {len(pool)} examples")
        # img_id -> small int, to compare images without strings: the pool's image table, then the held
        # set's other images
        codes = {name: i for i, name in enumerate(pool.images)}
        self.image_codes = codes
        self.pool_images = pool.column("image")
        # each sentence's hash, and the (image, sentence) pairs the sets hold (`held`: e.g. the validation
        # examples, never drawn): a sentence of another image that this image holds too ("how many shapes
        # are there?", a repeated caption) is no mismatch
        self.pool_sentences = pool.column("sentence_hash")
        held = held if isinstance(held, PretrainCorpus) else PretrainCorpus.from_examples(list(held))
        held_codes = np.array([codes.setdefault(name, len(codes)) for name in held.images], dtype=np.int64)
        held_images = held_codes[held.column("image")] if len(held) else np.zeros(0, np.int64)
        held_sentences = held.column("sentence_hash")
        keys, first = np.unique(
            np.concatenate(
                [_pair_keys(self.pool_images, self.pool_sentences), _pair_keys(held_images, held_sentences)]
            ),
            return_index=True,
        )
        # only sentences two or more images hold can make a drawn one its own image's too: a sentence held
        # by one image is held by the image it was drawn from, never the row's (the draw needs another);
        # the pairs kept are few, and each batch's lookups among them stay in cache
        hashes = np.concatenate([self.pool_sentences, held_sentences])[first]
        sentence, images = np.unique(hashes, return_counts=True)
        self.held_pairs = keys[np.isin(hashes, sentence[images > 1])]
        self.special_ids = np.array(sorted(set(tokenizer.all_special_ids)))
        self.vocab_size = len(tokenizer)
        self.mask_id = tokenizer.mask_token_id
        self.pad_id = tokenizer.pad_token_id
        # WordPiece continuation pieces ("##..."), looked up by id instead of converting ids to strings
        pieces = tokenizer.convert_ids_to_tokens(list(range(self.vocab_size)))
        self.continues = np.array([str(p).startswith("##") for p in pieces], dtype=bool)
        self.qa_active = True

    def __call__(self, batch: PretrainBatch | list[PretrainBatch], rng: np.random.Generator) -> dict:
        if isinstance(batch, list):
            batch = PretrainBatch.concat(batch, self.pad_id)
        cfg = self.cfg
        regions = batch.regions
        own_images = np.array([self.image_codes.get(i, -1) for i in regions.img_ids], dtype=np.int64)
        ids, lengths, matched = self._sentences(batch, own_images, rng)
        attention = (np.arange(ids.shape[1])[None, :] < lengths[:, None]).astype(np.int64)
        out: dict = {
            "attention_mask": torch.from_numpy(attention),
            "token_type_ids": torch.zeros(ids.shape, dtype=torch.long),
        }
        if cfg.mlm:
            maskable = ~np.isin(ids, self.special_ids) & (attention == 1)
            if cfg.whole_words:
                continues = self.continues[np.clip(ids, 0, self.vocab_size - 1)] & maskable
                masked, lm_labels = mask_words(
                    ids, maskable, continues, rng, self.vocab_size, self.mask_id, cfg.mlm_prob
                )
            else:
                masked, lm_labels = mask_tokens(
                    ids, maskable, rng, self.vocab_size, self.mask_id, cfg.mlm_prob
                )
            out["input_ids"] = torch.from_numpy(masked)
            out["lm_labels"] = torch.from_numpy(lm_labels)
        else:
            out["input_ids"] = torch.from_numpy(ids)

        n = regions.boxes.shape[1]
        if n > self.max_boxes:
            raise ValueError(f"a batch holds {n} region slots, more than the {self.max_boxes} to pad to")
        feats, boxes, valid = regions.features, normalized_batch_boxes(regions), regions.valid
        if n < self.max_boxes:  # the set's width, whatever this batch holds
            grow = ((0, 0), (0, self.max_boxes - n))
            feats, boxes, valid = (
                np.pad(feats, grow + ((0, 0),)),
                np.pad(boxes, grow + ((0, 0),)),
                np.pad(valid, grow),
            )
        obj, obj_conf = _known(regions.objects_id, regions.objects_conf, self.max_boxes)
        attr, attr_conf = _known(regions.attrs_id, regions.attrs_conf, self.max_boxes)
        if cfg.obj or cfg.attr or cfg.feat or cfg.regions:
            group = np.unique(regions.img_ids, return_inverse=True)[1].reshape(-1)
            fates = {"zero": cfg.object_zero, "swap": cfg.object_swap}
            picked, zeroed, source = draw_object_masking(
                valid, group, rng, cfg.object_prob, **{k: v for k, v in fates.items() if v is not None}
            )
            # masked where the batch lands (apply_object_masking): the features cross once, unmasked
            out["visual_feats"] = torch.from_numpy(feats)
            out["object_zeroed"] = torch.from_numpy(zeroed)
            out["object_source"] = torch.from_numpy(source)
            chosen = picked if cfg.object_loss_on == "masked" else valid
            if cfg.obj:
                out["obj_labels"] = torch.from_numpy(obj)
                out["obj_weights"] = torch.from_numpy(obj_conf * chosen)
            if cfg.attr:
                out["attr_labels"] = torch.from_numpy(attr)
                out["attr_weights"] = torch.from_numpy(attr_conf * chosen)
            if cfg.feat:
                out["feat_weights"] = torch.from_numpy(picked.astype(np.float32))
            if cfg.regions:
                out.update(_region_targets(regions.class_probs, picked, obj, obj_conf, self.max_boxes))
        else:
            out["visual_feats"] = torch.from_numpy(feats)
        out["visual_pos"] = torch.from_numpy(boxes)
        out["visual_attention_mask"] = torch.from_numpy(valid.astype(np.int64))
        out[IMAGE_SIZE] = torch.from_numpy(image_sizes(regions.img_w, regions.img_h))
        if cfg.matched:
            out["matched_labels"] = torch.from_numpy(matched.astype(np.int64))
        if cfg.qa:
            answers = sample_answers(batch.answer_labels, batch.answer_scores, rng)
            out["answer_labels"] = torch.from_numpy(np.where(matched, answers, -100))
            if self.qa_active and batch.evaluation:
                out.update(self._qa_eval(batch, feats, boxes, valid))
        return out

    def _sentences(
        self, batch: PretrainBatch, own_images: np.ndarray, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(B, L) token ids, each row its own sentence or, with `mismatch_prob`, a sentence of another
        image drawn uniformly from the training set (up to MISMATCH_TRIES draws, as the release), one
        that the row's image does not also hold in the set;
        the token count of each row, and its matched flag."""
        cfg = self.cfg
        b = len(batch.indices)
        matched = np.ones(b, dtype=bool)
        lengths = batch.lengths.copy()
        if not cfg.matched:
            return batch.token_ids, lengths, matched
        swap = rng.random(b) < cfg.mismatch_prob
        draws = rng.integers(len(self.pool_images), size=(b, MISMATCH_TRIES))
        other = self.pool_images[draws] != own_images[:, None]
        other &= ~_held(_pair_keys(own_images[:, None], self.pool_sentences[draws]), self.held_pairs)
        found = other.any(axis=1)
        pick = draws[np.arange(b), np.argmax(other, axis=1)]
        swap &= found
        matched[swap] = False
        rows = np.nonzero(swap)[0]
        lengths[rows] = self.texts.lengths(pick[rows])
        width = int(lengths.max(initial=1))
        ids = np.full((b, width), self.pad_id, dtype=np.int64)
        keep = np.nonzero(~swap)[0]
        cols = min(width, batch.token_ids.shape[1])
        ids[keep, :cols] = batch.token_ids[keep, :cols]
        if rows.size:
            ids[rows] = self.texts.padded(pick[rows], self.pad_id, width)
        return ids, lengths, matched

    def _qa_eval(self, batch: PretrainBatch, feats: np.ndarray, boxes: np.ndarray, valid: np.ndarray) -> dict:
        """The questions of the batch as they are (no mismatch, no masking, padded to the longest of
        them) and their answers' soft scores."""
        rows = np.nonzero(batch.question)[0]
        if not rows.size:
            return {}
        length = int(batch.lengths[rows].max())
        qa_ids = np.full((rows.size, length), self.pad_id, dtype=np.int64)
        cols = min(length, batch.token_ids.shape[1])
        qa_ids[:, :cols] = batch.token_ids[rows, :cols]
        qa_attention = (np.arange(length)[None, :] < batch.lengths[rows][:, None]).astype(np.int64)
        answers = batch.answer_labels[rows]
        width = max(1, int((answers != -100).sum(axis=1).max()))
        qa_ids = torch.from_numpy(qa_ids)
        return {
            "qa_eval": {
                "input_ids": qa_ids,
                "attention_mask": torch.from_numpy(qa_attention),
                "token_type_ids": torch.zeros_like(qa_ids),
                "visual_feats": torch.from_numpy(feats[rows]),
                "visual_pos": torch.from_numpy(boxes[rows]),
                "visual_attention_mask": torch.from_numpy(valid[rows].astype(np.int64)),
            },
            "qa_eval_answers": torch.from_numpy(np.ascontiguousarray(answers[:, :width])),
            "qa_eval_scores": torch.from_numpy(np.ascontiguousarray(batch.answer_scores[rows, :width])),
            "qa_eval_sources": [batch.sources[k] for k in rows],
        }


def _known(labels: np.ndarray, conf: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Labels and confidences padded to `width` slots; regions imported without detector labels
    (UNKNOWN_LABEL, -1) train no label loss: label 0, weight 0."""
    unknown = labels < 0
    labels = np.where(unknown, 0, labels).astype(np.int64)
    conf = np.where(unknown, 0.0, conf).astype(np.float32)
    grow = ((0, 0), (0, width - labels.shape[1]))
    return np.pad(labels, grow), np.pad(conf, grow)


def _region_targets(
    probs: np.ndarray | None, picked: np.ndarray, obj: np.ndarray, conf: np.ndarray, width: int
) -> dict:
    """`region_mask` (B, N) and `region_probs` (B, N, C, float16 as stored) when every image of the batch
    has its class distribution, else `region_labels` / `region_weights`: the top class and its confidence
    (0 where the store has no label)."""
    out = {"region_mask": torch.from_numpy(picked.astype(np.float32))}
    if probs is not None:
        grow = width - probs.shape[1]
        out["region_probs"] = (
            torch.from_numpy(probs)
            if not grow
            else torch.from_numpy(np.pad(probs, ((0, 0), (0, grow), (0, 0))))
        )
    else:
        out["region_labels"] = torch.from_numpy(obj)
        out["region_weights"] = torch.from_numpy(conf)
    return out
