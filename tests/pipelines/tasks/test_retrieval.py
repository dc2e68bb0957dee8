"""Recall@k against a ranking computed independently, and the rankings file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipelines.data.retrieval import RetrievalExample, pair_key
from pipelines.tasks.retrieval import recall_at_k, write_rankings


def test_recall_matches_an_independent_ranking(tmp_path):
    rng = np.random.default_rng(0)
    images = [f"img{i}" for i in range(12)]
    examples = [RetrievalExample(f"{img}#{k}", img, "a caption", img) for img in images for k in range(2)]
    scores = rng.normal(size=(len(examples), len(images)))
    predictions = {
        pair_key(ex.caption_id, img): float(scores[c, i])
        for c, ex in enumerate(examples)
        for i, img in enumerate(images)
    }
    # independent: position of the own image in the descending order of the caption's scores
    ranks = [list(np.argsort(-scores[c])).index(images.index(ex.img_id)) + 1 for c, ex in enumerate(examples)]
    expected = {f"R@{k}": 100.0 * np.mean([r <= k for r in ranks]) for k in (1, 5, 10)}
    assert recall_at_k(predictions, examples) == pytest.approx(expected)
    path = write_rankings(tmp_path / "r.json", predictions)
    rows = {r["caption_id"]: r["images"] for r in json.loads(path.read_text())}
    assert rows["img3#1"] == [images[i] for i in np.argsort(-scores[7])[:10]]


def test_ties_count_against_and_gaps_are_named():
    examples = [RetrievalExample("a#0", "a", "x", "a"), RetrievalExample("b#0", "b", "y", "b")]
    tied = {pair_key(c, i): 0.0 for c in ("a#0", "b#0") for i in ("a", "b")}
    assert recall_at_k(tied, examples, ks=(1, 2)) == {"R@1": 0.0, "R@2": 100.0}
    del tied[pair_key("b#0", "a")]
    with pytest.raises(ValueError, match="no score for image 'a'"):
        recall_at_k(tied, examples)
