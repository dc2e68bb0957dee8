"""Pre-training collation: masked tokens, masked objects or regions, mismatched sentences, QA answers.

Runs in DataLoader workers; every random choice comes from the `rng` handed in, so a batch is a pure
function of its examples and its seed. Validation items (`"evaluation": True`) also get the questions'
clean inputs and the soft score of each of their answers in the table, for the QA accuracy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch

from pipelines.data.pretrain import PretrainExample
from pipelines.data.regions import pad_regions


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
    a random object of another image of the batch (`group` = image of each row), the rest kept (LXMERT:
    80/10/10, ViLBERT: 90/0/10). Returns (new features, picked)."""
    picked = (rng.random(valid.shape) < prob) & valid
    fate = rng.random(valid.shape)
    out = feats.copy()
    out[picked & (fate < zero)] = 0.0
    for b, n in zip(*np.nonzero(picked & (fate >= zero) & (fate < zero + swap)), strict=True):
        others = np.nonzero((group != group[b]) & valid.any(axis=1))[0]
        if len(others) == 0:
            continue  # a batch of one image has no other image to borrow from: the feature stays
        j = others[rng.integers(len(others))]
        slots = np.nonzero(valid[j])[0]
        out[b, n] = feats[j, slots[rng.integers(len(slots))]]
    return out, picked


def sample_answer(answers: Sequence[tuple[int, float]], rng: np.random.Generator) -> int:
    """One answer label drawn with probability proportional to its soft score (-100 when none)."""
    if not answers:
        return -100
    if len(answers) == 1:
        return answers[0][0]
    scores = np.array([s for _, s in answers], dtype=np.float64)
    if scores.sum() <= 0:
        return answers[int(rng.integers(len(answers)))][0]
    return answers[int(rng.choice(len(answers), p=scores / scores.sum()))][0]


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
    """(items of PretrainDataset, rng) -> the model's inputs and labels, padded to the set's max boxes.

    With QA on, `qa_active` (the task's QA schedule) and validation items, `qa_eval` holds every question
    of the batch, matched to its own image and unmasked, as model inputs; `qa_eval_answers` /
    `qa_eval_scores` (Q, K) its answers' labels (-100 pads) and soft scores; `qa_eval_sources` its `sentf`
    source names."""

    def __init__(
        self,
        tokenizer,
        examples: list[PretrainExample],
        max_boxes: int,
        cfg: MaskingConfig,
    ):
        self.tokenizer = tokenizer
        self.examples = examples  # where mismatched sentences come from (the training set)
        self.max_boxes = max_boxes
        self.cfg = cfg
        self.special_ids = np.array(sorted(set(tokenizer.all_special_ids)))
        self.vocab_size = len(tokenizer)
        self.qa_active = True

    def __call__(self, items: list[dict], rng: np.random.Generator) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        b, n = len(items), self.max_boxes
        sentences, matched = [], np.ones(b, dtype=np.int64)
        for k, item in enumerate(items):
            sentence = item["sentence"]
            if cfg.matched and rng.random() < cfg.mismatch_prob:
                other = self._other_sentence(item["img_id"], rng)
                if other is not None:
                    sentence, matched[k] = other, 0
            sentences.append(sentence)
        enc = self.tokenizer(
            sentences, truncation=True, max_length=cfg.max_seq_len, padding="longest", return_tensors="np"
        )
        ids = enc["input_ids"].astype(np.int64)
        attention = enc["attention_mask"].astype(np.int64)
        batch: dict[str, torch.Tensor] = {
            "attention_mask": torch.from_numpy(attention),
            "token_type_ids": torch.zeros_like(torch.from_numpy(ids)),
        }
        if cfg.mlm:
            maskable = ~np.isin(ids, self.special_ids) & (attention == 1)
            mask_id = self.tokenizer.mask_token_id
            if cfg.whole_words:
                pieces = np.array(self.tokenizer.convert_ids_to_tokens(ids.ravel().tolist())).reshape(
                    ids.shape
                )
                continues = np.char.startswith(pieces, "##") & maskable
                masked, lm_labels = mask_words(
                    ids, maskable, continues, rng, self.vocab_size, mask_id, cfg.mlm_prob
                )
            else:
                masked, lm_labels = mask_tokens(ids, maskable, rng, self.vocab_size, mask_id, cfg.mlm_prob)
            batch["input_ids"] = torch.from_numpy(masked)
            batch["lm_labels"] = torch.from_numpy(lm_labels)
        else:
            batch["input_ids"] = torch.from_numpy(ids)

        padded = pad_regions([it["features"] for it in items], [it["boxes"] for it in items], n)
        feats, boxes, valid = padded.feats, padded.boxes, padded.valid
        obj = np.zeros((b, n), dtype=np.int64)
        obj_conf = np.zeros((b, n), dtype=np.float32)
        attr = np.zeros((b, n), dtype=np.int64)
        attr_conf = np.zeros((b, n), dtype=np.float32)
        for k, item in enumerate(items):
            m = item["features"].shape[0]
            obj[k, :m], obj_conf[k, :m] = item["objects_id"], item["objects_conf"]
            attr[k, :m], attr_conf[k, :m] = item["attrs_id"], item["attrs_conf"]
        # regions imported without detector labels (UNKNOWN_LABEL, -1) train no label loss: label 0, weight 0
        for labels, conf in ((obj, obj_conf), (attr, attr_conf)):
            unknown = labels < 0
            labels[unknown], conf[unknown] = 0, 0.0
        visual = cfg.obj or cfg.attr or cfg.feat or cfg.regions
        if visual:
            group = np.unique([item["img_id"] for item in items], return_inverse=True)[1]
            fates = {"zero": cfg.object_zero, "swap": cfg.object_swap}
            masked_feats, picked = mask_objects(
                feats, valid, group, rng, cfg.object_prob, **{k: v for k, v in fates.items() if v is not None}
            )
            batch["visual_feats"] = torch.from_numpy(masked_feats)
            chosen = picked if cfg.object_loss_on == "masked" else valid
            if cfg.obj:
                batch["obj_labels"] = torch.from_numpy(obj)
                batch["obj_weights"] = torch.from_numpy(obj_conf * chosen)
            if cfg.attr:
                batch["attr_labels"] = torch.from_numpy(attr)
                batch["attr_weights"] = torch.from_numpy(attr_conf * chosen)
            if cfg.feat:
                batch["feat_targets"] = torch.from_numpy(feats)
                batch["feat_weights"] = torch.from_numpy(picked.astype(np.float32))
            if cfg.regions:
                batch.update(_region_targets(items, picked, obj, obj_conf))
        else:
            batch["visual_feats"] = torch.from_numpy(feats)
        batch["visual_pos"] = torch.from_numpy(boxes)
        batch["visual_attention_mask"] = torch.from_numpy(valid.astype(np.int64))
        if cfg.matched:
            batch["matched_labels"] = torch.from_numpy(matched)
        if cfg.qa:
            qa = [sample_answer(item["answers"], rng) if matched[k] else -100 for k, item in enumerate(items)]
            batch["answer_labels"] = torch.tensor(qa, dtype=torch.long)
            if self.qa_active and items[0].get("evaluation"):
                batch.update(self._qa_eval(items, ids, attention, matched, feats, boxes, valid))
        return batch

    def _qa_eval(
        self,
        items: list[dict],
        ids: np.ndarray,
        attention: np.ndarray,
        matched: np.ndarray,
        feats: np.ndarray,
        boxes: np.ndarray,
        valid: np.ndarray,
    ) -> dict:
        """The questions of the batch as they are (no mismatch, no masking) and their answers' soft scores.

        `ids` / `attention` are the batch's sentences tokenised before masking: a question still paired
        with its own image is reused from there, only the swapped-out ones are tokenised again."""
        rows = [k for k, item in enumerate(items) if item.get("question")]
        if not rows:
            return {}
        qa_ids, qa_attention = ids[rows], attention[rows]
        swapped = [q for q, k in enumerate(rows) if not matched[k]]
        if swapped:
            enc = self.tokenizer(
                [items[rows[q]]["sentence"] for q in swapped],
                truncation=True,
                max_length=self.cfg.max_seq_len,
                padding="longest",
                return_tensors="np",
            )
            cols = max(qa_ids.shape[1], enc["input_ids"].shape[1])
            pad = self.tokenizer.pad_token_id
            qa_ids, qa_attention = _pad_to(qa_ids, cols, pad), _pad_to(qa_attention, cols, 0)
            qa_ids[swapped] = _pad_to(enc["input_ids"], cols, pad)
            qa_attention[swapped] = _pad_to(enc["attention_mask"], cols, 0)
        length = int(qa_attention.sum(1).max())  # padded to the longest question, as tokenising them would
        qa_ids = torch.from_numpy(np.ascontiguousarray(qa_ids[:, :length]))
        qa_attention = torch.from_numpy(np.ascontiguousarray(qa_attention[:, :length]))
        width = max(1, max(len(items[k]["answers"]) for k in rows))
        answers = np.full((len(rows), width), -100, dtype=np.int64)
        scores = np.zeros((len(rows), width), dtype=np.float32)
        for q, k in enumerate(rows):
            for j, (label, score) in enumerate(items[k]["answers"]):
                answers[q, j], scores[q, j] = label, score
        return {
            "qa_eval": {
                "input_ids": qa_ids,
                "attention_mask": qa_attention,
                "token_type_ids": torch.zeros_like(qa_ids),
                "visual_feats": torch.from_numpy(feats[rows]),
                "visual_pos": torch.from_numpy(boxes[rows]),
                "visual_attention_mask": torch.from_numpy(valid[rows].astype(np.int64)),
            },
            "qa_eval_answers": torch.from_numpy(answers),
            "qa_eval_scores": torch.from_numpy(scores),
            "qa_eval_sources": [items[k]["source"] for k in rows],
        }

    def _other_sentence(self, img_id: str, rng: np.random.Generator, tries: int = 10) -> str | None:
        """A sentence of a different image, drawn from the whole set as the release does."""
        for _ in range(tries):
            other = self.examples[int(rng.integers(len(self.examples)))]
            if other.img_id != img_id:
                return other.sentence
        return None


def _region_targets(items: list[dict], picked: np.ndarray, obj: np.ndarray, conf: np.ndarray) -> dict:
    """`region_mask` (B, N) and `region_probs` (B, N, C) when every image of the batch has its class
    distribution, else `region_labels` / `region_weights`: the top class and its confidence (0 where the
    store has no label)."""
    out = {"region_mask": torch.from_numpy(picked.astype(np.float32))}
    probs = [item.get("class_probs") for item in items]
    if all(p is not None for p in probs):
        b, n = picked.shape
        dense = np.zeros((b, n, probs[0].shape[1]), dtype=np.float32)
        for k, p in enumerate(probs):
            dense[k, : p.shape[0]] = p
        out["region_probs"] = torch.from_numpy(dense)
    else:
        known = obj >= 0
        out["region_labels"] = torch.from_numpy(np.where(known, obj, 0))
        out["region_weights"] = torch.from_numpy(np.where(known, conf, 0.0).astype(np.float32))
    return out


def _pad_to(a: np.ndarray, width: int, value: int) -> np.ndarray:
    """(R, L) -> (R, width), new columns filled with `value`."""
    return np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=value)
