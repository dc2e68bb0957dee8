"""VL-BERT's region masking in the collator: masked regions named, with the store's class distributions
as targets when every record has them, else the detector's top class (shifted past background)."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.data.masking import MaskingConfig, PretrainCollator
from pipelines.data.text import load_tokenizer

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "red", "circle", "play", "##ing"]


def _items(with_probs: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    items = []
    for k, n in enumerate((3, 2)):
        probs = rng.dirichlet(np.ones(5), size=n).astype(np.float16)
        items.append({
            "img_id": f"i{k}", "sentence": "a red circle playing", "answers": (),
            "features": rng.random((n, 4), dtype=np.float32), "boxes": rng.random((n, 4), dtype=np.float32),
            "objects_id": np.array([0, 2, -1][:n]), "objects_conf": np.full(n, 0.5, np.float32),
            "attrs_id": np.zeros(n, np.int64), "attrs_conf": np.ones(n, np.float32),
            "class_probs": probs if with_probs else None,
        })  # fmt: skip
    return items


@pytest.fixture
def tokenizer(tmp_path):
    (tmp_path / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    return load_tokenizer(tmp_path / "vocab.txt")


@pytest.mark.parametrize("with_probs", [True, False])
def test_masked_regions_and_their_targets(tokenizer, with_probs):
    cfg = MaskingConfig(matched=False, qa=False, attr=False, feat=False, masked_regions=True, object_prob=0.5)
    batch = PretrainCollator(tokenizer, [], 3, cfg)(_items(with_probs), np.random.default_rng(3))
    masked = batch["masked_regions"].numpy()
    assert masked.shape == (2, 3) and masked.any() and not masked[1, 2]  # never a padded region
    assert ("region_targets" in batch) == with_probs
    if with_probs:
        assert batch["region_targets"].shape == (2, 3, 5)
    # hard labels: object k is class k + 1 (background first); an unknown label (-1) weighs nothing
    assert batch["obj_labels"][0].tolist() == [1, 3, 0]
    weights = batch["obj_weights"].numpy()
    assert (
        weights[0, 2] == 0 and (weights[~masked] == 0).all() and (weights[0, :2][masked[0, :2]] == 0.5).all()
    )
