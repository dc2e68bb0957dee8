"""COCO caption scoring: CIDEr-D equals pycocoevalcap's; BLEU/METEOR/ROUGE-L through pycocoevalcap."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pipelines.scoring.captions import evaluate_captions, java_available, simple_tokenize
from pipelines.scoring.cider import CiderD

pycocoevalcap = pytest.importorskip("pycocoevalcap")
from pycocoevalcap.bleu.bleu import Bleu  # noqa: E402
from pycocoevalcap.cider.cider import Cider  # noqa: E402

WORDS = [
    "a",
    "the",
    "dog",
    "cat",
    "man",
    "woman",
    "on",
    "sits",
    "red",
    "ball",
    "table",
    "with",
    "of",
    "in",
    "blue",
    "two",
]


def random_corpus(seed: int, images: int = 40) -> tuple[dict[int, list[str]], dict[int, list[str]]]:
    rng = random.Random(seed)
    refs = {
        i: [" ".join(rng.choices(WORDS, k=rng.randint(1, 12))) for _ in range(rng.randint(1, 5))]
        for i in range(images)
    }
    res = {i: [" ".join(rng.choices(WORDS, k=rng.randint(0, 12)))] for i in range(images)}
    res[0] = [refs[0][0]]  # an exact match
    res[1] = ["dog"]  # one word: no bigram, the length term's corner
    return refs, res


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cider_d_equals_pycocoevalcap(seed):
    refs, res = random_corpus(seed)
    expected, expected_each = Cider().compute_score(refs, res)
    score, each = CiderD(refs).corpus_score({k: v[0] for k, v in res.items()})
    assert score == pytest.approx(expected, rel=1e-12, abs=1e-12)
    np.testing.assert_allclose(each, expected_each, rtol=1e-12, atol=1e-12)


def test_cider_d_with_training_document_frequencies():
    """SCST: df from a fixed (training) corpus; a subset scored alone matches scoring the full corpus."""
    refs, res = random_corpus(3)
    _, expected_each = Cider().compute_score(refs, res)
    cider = CiderD(refs)
    some = [5, 9, 9, 17]
    np.testing.assert_allclose(cider.scores((k, res[k][0]) for k in some), expected_each[some], rtol=1e-12)
    with pytest.raises(KeyError, match="no references"):
        cider.score_one(999, "a dog")


def test_bleu_rouge_cider_through_pycocoevalcap_pretokenized():
    refs, res = random_corpus(4, images=10)
    scores = evaluate_captions(refs, {k: v[0] for k, v in res.items()}, pretokenized=True, java=False)
    bleu, _ = Bleu(4).compute_score(refs, res, verbose=0)
    for n in range(4):
        assert scores.metrics[f"Bleu_{n + 1}"] == pytest.approx(bleu[n])
    assert scores.metrics["CIDEr"] == pytest.approx(Cider().compute_score(refs, res)[0])
    assert 0.0 < scores.metrics["ROUGE_L"] <= 1.0
    assert scores.skipped["SPICE"] == "not requested"
    assert "java=False" in scores.skipped["METEOR"]


@pytest.mark.skipif(not java_available(), reason="java not on PATH: the PTB tokenizer and METEOR need a JRE")
def test_meteor_and_ptb_tokenizer_with_java():
    refs = {1: ["A dog runs on the grass.", "A brown dog running in a field."], 2: ["Two men ride bikes!"]}
    preds = {1: "A dog running on grass.", 2: "two men riding bikes"}
    scores = evaluate_captions(refs, preds)
    assert "PTBTokenizer" not in scores.skipped
    assert 0.2 < scores.metrics["METEOR"] < 1.0
    assert scores.metrics["Bleu_1"] > 0.5
    # SPICE runs only with the CoreNLP jars; otherwise the reason names what is missing.
    assert "SPICE" in scores.metrics or "stanford-corenlp" in scores.skipped["SPICE"]
    assert "METEOR" in scores.summary()


def test_skips_are_reported_without_java(monkeypatch):
    monkeypatch.setattr("pipelines.scoring.captions.java_available", lambda: False)
    scores = evaluate_captions({1: ["A dog, running."]}, {1: "a dog running"})
    assert set(scores.skipped) == {"PTBTokenizer", "METEOR", "SPICE"}
    assert "java not found" in scores.skipped["METEOR"]
    assert scores.metrics["Bleu_1"] == pytest.approx(1.0)
    assert "skipped" in scores.summary()


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="no references"):
        evaluate_captions({1: ["a dog"]}, {2: "a dog"}, pretokenized=True)
    assert simple_tokenize("A Dog's ball, (red).") == "a dog's ball red"
