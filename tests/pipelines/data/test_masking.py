"""Masking and collation rates over many samples, against the SPEC's probabilities."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.data.masking import MaskingConfig, PretrainCollator, mask_objects, mask_tokens, sample_answer
from pipelines.data.pretrain import PretrainExample
from pipelines.data.text import build_vocab, load_tokenizer

VOCAB, MASK = 1000, 4


def _tolerance(p: float, n: int) -> float:
    return 5 * np.sqrt(p * (1 - p) / n)  # five standard errors


def test_token_masking_rates_and_specials():
    rng = np.random.default_rng(0)
    ids = rng.integers(10, VOCAB, size=(4000, 20))
    ids[:, 0] = 2  # [CLS]
    lengths = rng.integers(3, 21, size=4000)
    for row, n in enumerate(lengths):
        ids[row, n - 1] = 3  # [SEP]
        ids[row, n:] = 0  # [PAD]
    maskable = ~np.isin(ids, [0, 2, 3])
    out, labels = mask_tokens(ids, maskable, rng, VOCAB, MASK, 0.15)
    picked = labels != -100
    assert not picked[~maskable].any(), "[CLS], [SEP] or padding was picked"
    assert (out[~maskable] == ids[~maskable]).all()
    assert (labels[picked] == ids[picked]).all()
    n = int(maskable.sum())
    assert abs(picked.sum() / n - 0.15) < _tolerance(0.15, n)
    k = int(picked.sum())
    to_mask = out[picked] == MASK
    kept = out[picked] == ids[picked]
    random = ~to_mask & ~kept
    assert abs(to_mask.mean() - 0.8) < _tolerance(0.8, k)
    # a random token can equal the original (1/VOCAB of the time): it then counts as kept
    assert abs(random.mean() - 0.1) < _tolerance(0.1, k)
    assert abs(kept.mean() - 0.1) < _tolerance(0.1, k) + 0.1 / VOCAB
    assert (out[~picked] == ids[~picked]).all()


def test_object_masking_rates_and_borrowed_features():
    rng = np.random.default_rng(1)
    b, n, d = 8, 10, 6
    picked_total = zeroed = borrowed = kept = 0
    for _ in range(500):
        feats = rng.normal(size=(b, n, d)).astype(np.float32) + 5
        valid = np.ones((b, n), dtype=bool)
        valid[0, 7:] = False
        group = np.array([0, 0, 1, 2, 3, 4, 5, 6])  # rows 0 and 1 show the same image
        out, picked = mask_objects(feats, valid, group, rng, 0.15)
        assert not picked[~valid].any()
        assert (out[~picked] == feats[~picked]).all()
        for i, j in zip(*np.nonzero(picked), strict=True):
            picked_total += 1
            if not out[i, j].any():
                zeroed += 1
            elif (out[i, j] == feats[i, j]).all():
                kept += 1
            else:
                borrowed += 1
                donors = np.nonzero(group != group[i])[0]
                assert any((out[i, j] == feats[r][valid[r]]).all(-1).any() for r in donors)
    assert abs(picked_total / (500 * (b * n - 3)) - 0.15) < _tolerance(0.15, 500 * (b * n - 3))
    for count, p in ((zeroed, 0.8), (borrowed, 0.1), (kept, 0.1)):
        assert abs(count / picked_total - p) < _tolerance(p, picked_total)


def test_one_image_batch_has_nobody_to_borrow_from():
    rng = np.random.default_rng(2)
    feats = rng.normal(size=(2, 50, 3)).astype(np.float32) + 5
    out, picked = mask_objects(feats, np.ones((2, 50), bool), np.zeros(2, int), rng, 1.0)
    changed = out.any(-1) & (out != feats).any(-1)
    assert picked.all() and not changed.any()


def test_answers_sampled_by_soft_score():
    rng = np.random.default_rng(3)
    draws = [sample_answer(((4, 0.9), (7, 0.3)), rng) for _ in range(4000)]
    assert set(draws) == {4, 7}
    assert abs(np.mean(np.array(draws) == 4) - 0.75) < _tolerance(0.75, 4000)
    assert sample_answer((), rng) == -100
    assert sample_answer(((5, 1.0),), rng) == 5


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("vocab") / "corpus.txt"
    words = [
        "a",
        "red",
        "circle",
        "next",
        "to",
        "blue",
        "square",
        "green",
        "star",
        "what",
        "color",
        "is",
        "the",
        "heart",
    ]
    corpus.write_text("\n".join(" ".join(words[i:] + words[:i]) for i in range(len(words))))
    return load_tokenizer(build_vocab([corpus], corpus.with_name("vocab.txt"), 100))


def _items(n: int, rng: np.random.Generator, boxes: int = 5):
    items = []
    for k in range(n):
        m = boxes - (k % 2)
        items.append(
            {
                "img_id": f"img{k % (n // 2)}",
                "sentence": "a red circle next to blue square" if k % 3 else "what color is the star",
                "answers": ((1, 1.0),) if k % 3 == 0 else (),
                "features": rng.normal(size=(m, 4)).astype(np.float32),
                "boxes": rng.uniform(size=(m, 4)).astype(np.float32),
                "objects_id": rng.integers(8, size=m),
                "objects_conf": rng.uniform(0.5, 1, size=m).astype(np.float32),
                "attrs_id": rng.integers(6, size=m),
                "attrs_conf": rng.uniform(0.5, 1, size=m).astype(np.float32),
            }
        )
    return items


def test_collator_matching_qa_and_weights(tokenizer):
    rng = np.random.default_rng(4)
    pool = [PretrainExample(f"img{i}", f"sentence number {i}", "x") for i in range(40)]
    collate = PretrainCollator(tokenizer, pool, max_boxes=7, cfg=MaskingConfig())
    mismatched = qa = qa_possible = 0
    for _ in range(200):
        items = _items(12, rng)
        batch = collate(items, rng)
        ids = batch["input_ids"]
        assert ids.shape[0] == 12 and ids.shape[1] <= 20
        assert batch["visual_feats"].shape == (12, 7, 4)
        vmask = batch["visual_attention_mask"].numpy()
        assert (vmask.sum(1) == [len(i["features"]) for i in items]).all()
        matched = batch["matched_labels"].numpy()
        answers = batch["answer_labels"].numpy()
        mismatched += int((matched == 0).sum())
        assert (answers[matched == 0] == -100).all(), "QA on a mismatched pair"
        has_answer = np.array([bool(i["answers"]) for i in items])
        assert (answers[~has_answer] == -100).all()
        assert (answers[has_answer & (matched == 1)] == 1).all()
        qa += int((answers != -100).sum())
        qa_possible += int(has_answer.sum())
        # release rule: label losses on every real object, weighted by confidence
        np.testing.assert_allclose(
            batch["obj_weights"].numpy()[vmask == 1],
            np.concatenate([i["objects_conf"] for i in items]),
        )
        assert (batch["obj_weights"].numpy()[vmask == 0] == 0).all()
        assert set(np.unique(batch["feat_weights"].numpy())) <= {0.0, 1.0}
        np.testing.assert_array_equal(
            batch["feat_targets"].numpy()[vmask == 1], np.concatenate([i["features"] for i in items])
        )
        lm = batch["lm_labels"].numpy()
        attention = batch["attention_mask"].numpy()
        sep = attention.sum(1) - 1
        assert (lm[:, 0] == -100).all() and (lm[np.arange(12), sep] == -100).all()
        assert (lm[attention == 0] == -100).all()
    total = 200 * 12
    assert abs(mismatched / total - 0.5) < _tolerance(0.5, total)
    assert abs(qa / qa_possible - 0.5) < _tolerance(0.5, qa_possible)


def test_collator_masked_only_weights_and_switches(tokenizer):
    rng = np.random.default_rng(5)
    pool = [PretrainExample(f"img{i}", f"sentence {i}", "x") for i in range(10)]
    cfg = MaskingConfig(object_loss_on="masked", mlm=False, matched=False, feat=False)
    batch = PretrainCollator(tokenizer, pool, max_boxes=5, cfg=cfg)(_items(8, rng), rng)
    assert {"lm_labels", "matched_labels", "feat_targets"}.isdisjoint(batch)
    picked = batch["visual_feats"].numpy()
    weights = batch["obj_weights"].numpy()
    assert ((weights > 0).sum()) < (batch["visual_attention_mask"].numpy().sum())
    assert picked.shape == (8, 5, 4)
    assert (batch["answer_labels"].numpy()[[0, 3, 6]] == 1).all()  # no mismatching: every pair is matched


def test_validation_items_carry_every_question_clean_with_its_soft_scores(tokenizer):
    rng = np.random.default_rng(6)
    pool = [PretrainExample(f"img{i}", f"sentence number {i}", "x") for i in range(40)]
    collate = PretrainCollator(tokenizer, pool, max_boxes=7, cfg=MaskingConfig(mismatch_prob=1.0))
    items = _items(12, rng)
    for k, item in enumerate(items):
        item["question"] = k % 3 == 0  # the questions; item 9 has no answer in the table
        item["answers"] = ((1, 1.0), (4, 0.3)) if k in (0, 6) else ((2, 0.6),) if k == 3 else ()
        item["source"] = "vqa" if k < 6 else "gqa"
    assert "qa_eval" not in collate(items, rng), "training batches carry no evaluation inputs"
    for item in items:
        item["evaluation"] = True
    batch = collate(items, rng)
    assert (batch["matched_labels"] == 0).all()  # every pair mismatched, so no QA label in the main pass
    rows = [0, 3, 6, 9]
    clean = _tokenise(tokenizer, [items[k]["sentence"] for k in rows])
    qa = batch["qa_eval"]
    np.testing.assert_array_equal(qa["input_ids"].numpy(), clean["input_ids"])
    np.testing.assert_array_equal(qa["attention_mask"].numpy(), clean["attention_mask"])
    for q, k in enumerate(rows):
        m = len(items[k]["features"])
        np.testing.assert_array_equal(qa["visual_feats"][q, :m].numpy(), items[k]["features"])
        assert not qa["visual_feats"][q, m:].any() and qa["visual_attention_mask"][q].sum() == m
        np.testing.assert_array_equal(qa["visual_pos"][q, :m].numpy(), items[k]["boxes"])
    assert batch["qa_eval_answers"].tolist() == [[1, 4], [2, -100], [1, 4], [-100, -100]]
    np.testing.assert_allclose(batch["qa_eval_scores"].numpy(), [[1.0, 0.3], [0.6, 0], [1.0, 0.3], [0, 0]])
    assert batch["qa_eval_sources"] == ["vqa", "vqa", "gqa", "gqa"]
    for item in items:
        item["question"] = False
    assert "qa_eval" not in collate(items, rng), "no question, no QA evaluation"


def _tokenise(tokenizer, sentences: list[str]):
    """The questions as the collator must encode them: [CLS] ... [SEP], at most 20 tokens, padded."""
    return tokenizer(sentences, padding="longest", max_length=20, truncation=True, return_tensors="np")


class _CountingTokenizer:
    """The tokenizer, recording the sentences of each call."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def __call__(self, sentences, **kw):
        self.calls.append(list(sentences))
        return self.tokenizer(sentences, **kw)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)


def test_clean_questions_reuse_the_batch_tokens_and_wait_for_qa(tokenizer):
    counting = _CountingTokenizer(tokenizer)
    # long pool sentences: a batch is often padded wider than its questions need
    pool = [
        PretrainExample(f"img{i}", f"a red circle next to blue square and green star {i}", "x")
        for i in range(40)
    ]
    collate = PretrainCollator(counting, pool, max_boxes=7, cfg=MaskingConfig())
    items = _items(12, np.random.default_rng(7))
    for k, item in enumerate(items):
        item.update(question=k % 2 == 0, answers=((1, 1.0),), source="vqa", evaluation=True)
    rows = [k for k in range(12) if items[k]["question"]]
    clean = _tokenise(tokenizer, [items[k]["sentence"] for k in rows])
    seen = set()
    for seed in range(20):
        counting.calls.clear()
        batch = collate(items, np.random.default_rng(seed))
        qa = batch["qa_eval"]
        np.testing.assert_array_equal(qa["input_ids"].numpy(), clean["input_ids"])
        np.testing.assert_array_equal(qa["attention_mask"].numpy(), clean["attention_mask"])
        swapped = [items[k]["sentence"] for k in rows if batch["matched_labels"][k] == 0]
        # one call for the batch, one more only for the questions whose pair was swapped
        assert counting.calls[1:] == ([swapped] if swapped else [])
        seen.add(0 < len(swapped) < len(rows))
    assert True in seen, "no batch mixed kept and swapped questions"
    collate.qa_active = False  # before QA starts (the task's schedule): no clean questions built
    counting.calls.clear()
    assert "qa_eval" not in collate(items, np.random.default_rng(0))
    assert len(counting.calls) == 1
