"""Masking and collation: rates over many samples against the SPEC's probabilities, and the vectorised
collator against a per-example reference written here (same draws, same batch)."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.data.masking import (
    MISMATCH_TRIES,
    MaskingConfig,
    PretrainCollator,
    apply_object_masking,
    mask_objects,
    mask_tokens,
    sample_answers,
)
from pipelines.data.pretrain import PretrainBatch, PretrainExample, answer_arrays
from pipelines.data.text import EncodedTexts, build_vocab, load_tokenizer
from storage.batch import RegionBatch

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


def _reference_answer(pairs, u: float) -> int:
    """One answer by soft score, the straightforward way: walk the cumulative shares until u passes."""
    if not pairs:
        return -100
    scores = [max(s, 0.0) for _, s in pairs]
    total = sum(scores)
    if total <= 0:
        scores, total = [1.0] * len(pairs), float(len(pairs))
    acc = 0.0
    for (label, _), score in zip(pairs, scores, strict=True):
        acc += score
        if u * total < acc:
            return label
    return pairs[-1][0]


def test_answers_sampled_by_soft_score():
    rows = [((4, 0.9), (7, 0.3)), (), ((5, 1.0),), ((2, 0.0), (3, 0.0)), ((1, 0.0), (6, 0.6))] * 2000
    labels, scores = answer_arrays(rows)
    draws = sample_answers(labels, scores, np.random.default_rng(3))
    u = np.random.default_rng(3).random(len(rows))  # the draw sample_answers takes first
    assert draws.tolist() == [_reference_answer(p, x) for p, x in zip(rows, u, strict=True)]
    first = draws[0::5]
    assert set(first) == {4, 7}
    assert abs(np.mean(first == 4) - 0.75) < _tolerance(0.75, first.size)
    assert (draws[1::5] == -100).all() and (draws[2::5] == 5).all()
    assert abs(np.mean(draws[3::5] == 2) - 0.5) < _tolerance(0.5, 2000), "scores of 0: uniform"
    assert (draws[4::5] == 6).all(), "an answer scored 0 is never drawn beside a positive one"


def test_borrowed_objects_come_uniformly_from_the_other_images():
    rng = np.random.default_rng(8)
    b, n = 4, 3
    feats = np.arange(b * n, dtype=np.float32).reshape(b, n, 1) + 1  # each object's own value
    valid = np.ones((b, n), dtype=bool)
    valid[3, 1:] = False  # row 3 lends only its first object
    group = np.array([0, 0, 1, 2])  # rows 0 and 1 show one image: they never lend to each other
    counts = np.zeros(b * n + 1)
    for _ in range(3000):
        out, picked = mask_objects(feats, valid, group, rng, 1.0, zero=0.0, swap=1.0)
        counts += np.bincount(out[0, :, 0].astype(int), minlength=b * n + 1)
    lent = counts / counts.sum()
    # row 0 borrows from rows 2 and 3 (each 1/2), then one of their real objects uniformly
    expected = np.zeros(b * n + 1)
    expected[feats[2, :, 0].astype(int)] = 1 / 6
    expected[int(feats[3, 0, 0])] = 1 / 2
    assert np.abs(lent - expected).max() < _tolerance(0.5, int(counts.sum()))


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
                "features": rng.normal(size=(m, 4)).astype(np.float16),
                "boxes": rng.uniform(size=(m, 4)).astype(np.float32),
                "objects_id": rng.integers(8, size=m),
                "objects_conf": rng.uniform(0.5, 1, size=m).astype(np.float32),
                "attrs_id": rng.integers(6, size=m),
                "attrs_conf": rng.uniform(0.5, 1, size=m).astype(np.float32),
            }
        )
    return items


def _batch(items: list[dict], tokenizer, evaluation: bool = False) -> PretrainBatch:
    """The PretrainBatch a dataset would read for `items` (images 1 x 1: boxes are already normalised)."""
    b, n = len(items), max(len(it["features"]) for it in items)
    counts = np.array([len(it["features"]) for it in items])

    def padded(name: str, dtype, tail=()) -> np.ndarray:
        out = np.zeros((b, n, *tail), dtype=dtype)
        for k, it in enumerate(items):
            out[k, : counts[k]] = it[name]
        return out

    probs = [it.get("class_probs") for it in items]
    texts = EncodedTexts(tokenizer, [it["sentence"] for it in items], 20)
    labels, scores = answer_arrays([it["answers"] for it in items])
    return PretrainBatch(
        indices=np.arange(b),
        regions=RegionBatch(
            img_ids=[it["img_id"] for it in items],
            img_h=np.ones(b, np.int64),
            img_w=np.ones(b, np.int64),
            num_boxes=counts,
            boxes=padded("boxes", np.float32, (4,)),
            features=padded("features", np.float16, (items[0]["features"].shape[1],)),
            objects_id=padded("objects_id", np.int64),
            objects_conf=padded("objects_conf", np.float32),
            attrs_id=padded("attrs_id", np.int64),
            attrs_conf=padded("attrs_conf", np.float32),
            class_probs=padded("class_probs", np.float16, probs[0].shape[1:])
            if all(p is not None for p in probs)
            else None,
        ),
        token_ids=texts.padded(np.arange(b), tokenizer.pad_token_id),
        lengths=texts.lengths(np.arange(b)),
        answer_labels=labels,
        answer_scores=scores,
        question=np.array([bool(it.get("question", bool(it["answers"]))) for it in items]),
        sources=[it.get("source", "x") for it in items],
        evaluation=evaluation,
    )


def _reference_collate(items: list[dict], tokenizer, pool: list[PretrainExample], cfg, width, rng) -> dict:
    """The pre-training batch built example by example (tokenizer per batch, loops per token and per
    object), from the same draws the collator takes, in its order."""
    b = len(items)
    vocab, mask_id = len(tokenizer), tokenizer.mask_token_id
    swap_u = rng.random(b)
    tries = rng.integers(len(pool), size=(b, MISMATCH_TRIES))
    sentences, matched = [], []
    for k, it in enumerate(items):
        held = {e.sentence for e in pool if e.img_id == it["img_id"]}  # no mismatch: its image has it
        other = next(
            (pool[j] for j in tries[k] if pool[j].img_id != it["img_id"] and pool[j].sentence not in held),
            None,
        )
        swap = swap_u[k] < cfg.mismatch_prob and other is not None
        sentences.append(other.sentence if swap else it["sentence"])
        matched.append(0 if swap else 1)
    enc = tokenizer(sentences, truncation=True, max_length=20, padding="longest")
    ids = [list(r) for r in enc["input_ids"]]
    attention = [list(r) for r in enc["attention_mask"]]
    shape = (b, len(ids[0]))
    pick_u, fate_u = rng.random(shape), rng.random(shape)
    specials = set(tokenizer.all_special_ids)
    masked, lm, swaps = [r[:] for r in ids], [[-100] * shape[1] for _ in range(b)], []
    for k in range(b):
        for t in range(shape[1]):
            if attention[k][t] and ids[k][t] not in specials and pick_u[k, t] < cfg.mlm_prob:
                lm[k][t] = ids[k][t]
                if fate_u[k, t] < 0.8:
                    masked[k][t] = mask_id
                elif fate_u[k, t] < 0.9:
                    swaps.append((k, t))
    for (k, t), token in zip(swaps, rng.integers(0, vocab, size=len(swaps)), strict=True):
        masked[k][t] = int(token)
    feats = np.zeros((b, width, items[0]["features"].shape[1]), np.float16)
    valid = np.zeros((b, width), bool)
    for k, it in enumerate(items):
        feats[k, : len(it["features"])] = it["features"]
        valid[k, : len(it["features"])] = True
    pick_o, fate_o = rng.random((b, width)), rng.random((b, width))
    out, picked, lent = feats.copy(), np.zeros((b, width), bool), []
    for k in range(b):
        for j in range(width):
            if valid[k, j] and pick_o[k, j] < cfg.object_prob:
                picked[k, j] = True
                if fate_o[k, j] < 0.8:
                    out[k, j] = 0
                elif fate_o[k, j] < 0.9:
                    lent.append((k, j))
    u = rng.random((len(lent), 2))
    for (k, j), (u_row, u_obj) in zip(lent, u, strict=True):
        donors = [r for r in range(b) if items[r]["img_id"] != items[k]["img_id"]]
        if donors:
            r = donors[int(u_row * len(donors))]
            out[k, j] = feats[r, int(u_obj * len(items[r]["features"]))]
    answer_u = rng.random(b)
    answers = [
        _reference_answer(it["answers"], answer_u[k]) if matched[k] else -100 for k, it in enumerate(items)
    ]
    return {
        "input_ids": np.array(masked),
        "attention_mask": np.array(attention),
        "lm_labels": np.array(lm),
        "matched_labels": np.array(matched),
        "visual_feats": out,
        "feat_targets": feats,
        "feat_weights": picked.astype(np.float32),
        "visual_attention_mask": valid.astype(np.int64),
        "answer_labels": np.array(answers),
    }


def test_collator_equals_the_per_example_reference(tokenizer):
    """Same seed, same batch: the vectorised collator and the loops above agree on every field."""
    pool = [PretrainExample(f"img{i % 9}", f"a red circle next to {i} blue squares", "x") for i in range(30)]
    cfg = MaskingConfig(object_zero=0.8, object_swap=0.1, whole_words=False, object_prob=0.3, mlm_prob=0.3)
    collate = PretrainCollator(tokenizer, pool, max_boxes=6, cfg=cfg)
    for seed in range(25):
        items = _items(10, np.random.default_rng(100 + seed))
        items[1]["img_id"] = "img3"  # an image of the pool: its mismatches must come from others
        got = apply_object_masking(collate(_batch(items, tokenizer), np.random.default_rng(seed)))
        want = _reference_collate(items, tokenizer, pool, cfg, 6, np.random.default_rng(seed))
        for key, value in want.items():
            np.testing.assert_array_equal(got[key].numpy(), value, err_msg=f"{key}, seed {seed}")


def test_collator_matching_qa_and_weights(tokenizer):
    rng = np.random.default_rng(4)
    pool = [PretrainExample(f"img{i}", f"sentence number {i}", "x") for i in range(40)]
    collate = PretrainCollator(tokenizer, pool, max_boxes=7, cfg=MaskingConfig())
    mismatched = qa = qa_possible = 0
    for _ in range(200):
        items = _items(12, rng)
        batch = apply_object_masking(collate(_batch(items, tokenizer), rng))
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
    collate = PretrainCollator(tokenizer, pool, max_boxes=5, cfg=cfg)
    batch = apply_object_masking(collate(_batch(_items(8, rng), tokenizer), rng))
    assert {"lm_labels", "matched_labels", "feat_targets"}.isdisjoint(batch)
    picked = batch["visual_feats"].numpy()
    weights = batch["obj_weights"].numpy()
    assert ((weights > 0).sum()) < (batch["visual_attention_mask"].numpy().sum())
    assert picked.shape == (8, 5, 4)
    assert (batch["answer_labels"].numpy()[[0, 3, 6]] == 1).all()  # no mismatching: every pair is matched


def test_a_sentence_the_image_also_holds_is_never_its_mismatch(tokenizer):
    """The demo's "how many shapes are there?" is asked of every scene: drawn from another scene it is
    still true of this one, so it must not be labelled a mismatch (matching then sat at chance)."""
    generic = "how many shapes are there"
    pool = [PretrainExample(f"img{i}", generic, "x") for i in range(6)]  # every image holds it
    pool += [PretrainExample(f"img{i}", f"a red circle next to {i} blue squares", "x") for i in range(6)]
    cfg = MaskingConfig(mismatch_prob=1.0, mlm=False)  # the ids as drawn, no word masked
    collate = PretrainCollator(tokenizer, pool, max_boxes=5, cfg=cfg)
    generic_ids = _tokenise(tokenizer, [generic])["input_ids"][0]
    swapped = 0
    for seed in range(20):
        rng = np.random.default_rng(seed)
        items = _items(6, rng)  # images img0..img2, each in the pool with the generic sentence
        batch = collate(_batch(items, tokenizer), rng)
        matched = batch["matched_labels"].numpy()
        ids = batch["input_ids"].numpy()
        for k in np.nonzero(matched == 0)[0]:
            swapped += 1
            row = ids[k][: len(generic_ids)]
            assert not np.array_equal(row, generic_ids), "a sentence its image holds, labelled mismatched"
    assert swapped > 60  # the other images' specific sentences are still drawn


def test_a_validation_image_keeps_its_own_sentences_out_of_its_mismatches(tokenizer):
    """Validation images are not in the draw pool; `held` tells the collator what they hold."""
    generic = "how many shapes are there"
    pool = [PretrainExample(f"train{i}", generic if i % 2 else f"{i} blue squares", "x") for i in range(20)]
    held = [PretrainExample(f"img{i}", generic, "x") for i in range(3)]  # the validation images' sentences
    cfg = MaskingConfig(mismatch_prob=1.0, mlm=False)
    generic_ids = _tokenise(tokenizer, [generic])["input_ids"][0]
    for collate, clean in ((PretrainCollator(tokenizer, pool, 5, cfg, held=held), True),
                           (PretrainCollator(tokenizer, pool, 5, cfg), False)):  # fmt: skip
        drawn_generic = 0
        for seed in range(10):
            rng = np.random.default_rng(seed)
            batch = collate(_batch(_items(6, rng), tokenizer, evaluation=True), rng)
            ids, matched = batch["input_ids"].numpy(), batch["matched_labels"].numpy()
            if ids.shape[1] >= len(generic_ids):  # else no row holds the generic sentence
                rows = ids[matched == 0][:, : len(generic_ids)]
                drawn_generic += int((rows == generic_ids).all(axis=1).sum())
        assert (drawn_generic == 0) == clean


def test_validation_items_carry_every_question_clean_with_its_soft_scores(tokenizer):
    rng = np.random.default_rng(6)
    pool = [PretrainExample(f"img{i}", f"sentence number {i}", "x") for i in range(40)]
    collate = PretrainCollator(tokenizer, pool, max_boxes=7, cfg=MaskingConfig(mismatch_prob=1.0))
    items = _items(12, rng)
    for k, item in enumerate(items):
        item["question"] = k % 3 == 0  # the questions; item 9 has no answer in the table
        item["answers"] = ((1, 1.0), (4, 0.3)) if k in (0, 6) else ((2, 0.6),) if k == 3 else ()
        item["source"] = "vqa" if k < 6 else "gqa"
    assert "qa_eval" not in collate(_batch(items, tokenizer), rng), (
        "training batches carry no evaluation inputs"
    )
    batch = collate(_batch(items, tokenizer, evaluation=True), rng)
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
        np.testing.assert_array_equal(qa["visual_pos"][q, :m].numpy(), np.clip(items[k]["boxes"], 0, 1))
    assert batch["qa_eval_answers"].tolist() == [[1, 4], [2, -100], [1, 4], [-100, -100]]
    np.testing.assert_allclose(batch["qa_eval_scores"].numpy(), [[1.0, 0.3], [0.6, 0], [1.0, 0.3], [0, 0]])
    assert batch["qa_eval_sources"] == ["vqa", "vqa", "gqa", "gqa"]
    for item in items:
        item["question"] = False
    assert "qa_eval" not in collate(_batch(items, tokenizer, True), rng), "no question, no QA evaluation"


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


def test_sentences_are_tokenised_once_not_per_batch(tokenizer):
    counting = _CountingTokenizer(tokenizer)
    pool = [PretrainExample(f"img{i}", f"a red circle next to blue square {i}", "x") for i in range(40)]
    collate = PretrainCollator(counting, pool, max_boxes=7, cfg=MaskingConfig())
    assert len(counting.calls) == 1, "the pool is tokenised up front"
    items = _items(12, np.random.default_rng(7))
    for k, item in enumerate(items):
        item.update(question=k % 2 == 0, answers=((1, 1.0),), source="vqa")
    batch = _batch(items, tokenizer, evaluation=True)
    rows = [k for k in range(12) if items[k]["question"]]
    clean = _tokenise(tokenizer, [items[k]["sentence"] for k in rows])
    counting.calls.clear()
    for seed in range(10):
        qa = collate(batch, np.random.default_rng(seed))["qa_eval"]
        np.testing.assert_array_equal(qa["input_ids"].numpy(), clean["input_ids"])
        np.testing.assert_array_equal(qa["attention_mask"].numpy(), clean["attention_mask"])
    assert counting.calls == [], "a batch calls no tokenizer"
    collate.qa_active = False  # before QA starts (the task's schedule): no clean questions built
    assert "qa_eval" not in collate(batch, np.random.default_rng(0))


def test_vilbert_region_masking_zeroes_or_keeps():
    """ViLBERT's rule: of the picked regions 90 % zeroed, 10 % kept, none borrowed."""
    rng = np.random.default_rng(2)
    feats = rng.normal(size=(4000, 10, 6)).astype(np.float32) + 5
    valid = np.ones((4000, 10), dtype=bool)
    out, picked = mask_objects(feats, valid, np.arange(4000), rng, 0.15, zero=0.9, swap=0.0)
    zeroed = ~out[picked].any(-1)
    kept = (out[picked] == feats[picked]).all(-1)
    assert (zeroed | kept).all()
    assert abs(zeroed.mean() - 0.9) < _tolerance(0.9, int(picked.sum()))


def test_region_targets_are_the_class_distribution_or_the_confident_top_class(tokenizer):
    rng = np.random.default_rng(5)
    items = _items(6, rng)
    for item in items:
        m = item["features"].shape[0]
        item["class_probs"] = rng.dirichlet(np.ones(9), size=m).astype(np.float16)
    pool = [PretrainExample(it["img_id"], it["sentence"], "x") for it in items]
    only_regions = MaskingConfig(obj=False, attr=False, feat=False, qa=False, object_prob=0.5)
    collate = PretrainCollator(tokenizer, pool, max_boxes=5, cfg=only_regions)
    batch = collate(_batch(items, tokenizer), np.random.default_rng(0))
    assert {"region_mask", "region_probs"} <= set(batch) and "obj_labels" not in batch
    for k, item in enumerate(items):
        m = item["features"].shape[0]
        np.testing.assert_allclose(
            batch["region_probs"][k, :m].numpy(), item["class_probs"].astype(np.float32)
        )
        assert not batch["region_probs"][k, m:].any() and not batch["region_mask"][k, m:].any()
    # One image without its distribution: every region falls back to its top class weighted by confidence,
    # and a region the store has no label for (-1) weighs nothing.
    items[0]["class_probs"] = None
    items[1]["objects_id"][0] = -1
    batch = collate(_batch(items, tokenizer), np.random.default_rng(0))
    assert "region_probs" not in batch
    assert batch["region_labels"][1, 0] == 0 and batch["region_weights"][1, 0] == 0
    m = items[2]["features"].shape[0]
    np.testing.assert_array_equal(batch["region_labels"][2, :m].numpy(), items[2]["objects_id"])
    np.testing.assert_allclose(batch["region_weights"][2, :m].numpy(), items[2]["objects_conf"])
