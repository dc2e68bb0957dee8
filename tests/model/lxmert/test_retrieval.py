"""LxmertForRetrieval: the pre-training matching head scores caption-image pairs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model import LxmertForPreTraining
from model.lxmert import LxmertForRetrieval


def _candidates(inputs: dict, k: int) -> dict:
    """Each caption against k images: image j of row i is row (i + j) % B's, so j = 0 is its own."""
    out = dict(inputs)
    for key in ("visual_feats", "visual_pos", "visual_attention_mask"):
        out[key] = torch.stack([inputs[key].roll(-j, dims=0) for j in range(k)], dim=1)
    return out


def test_matching_head_loads_from_pretraining_and_scores_log_odds(lx, tmp_path):
    cfg = lx.small_config()
    torch.manual_seed(0)
    pre = LxmertForPreTraining(cfg).eval()
    model = LxmertForRetrieval.from_pretrained(pre.save_pretrained(tmp_path / "pre")).eval()
    assert torch.equal(model.match_head.weight, pre.match_head.weight)
    inputs = lx.make_inputs(cfg)
    with torch.no_grad():
        matched = pre(**inputs).matched_logits
        pairs = model(**inputs, labels=torch.tensor([1, 0, 1]), output_attentions=True)
        ranked = model(**_candidates(inputs, 3), labels=torch.tensor([0, 0, 0]), output_attentions=True)
    torch.testing.assert_close(pairs.logits[:, 0], matched[:, 1] - matched[:, 0])
    torch.testing.assert_close(pairs.loss, F.cross_entropy(matched, torch.tensor([1, 0, 1])))
    assert pairs.region_attention.shape == inputs["visual_attention_mask"].shape
    assert ranked.logits.shape == (3, 3) and ranked.region_attention.shape == (3, 3, 5)
    torch.testing.assert_close(ranked.logits[:, 0], pairs.logits[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ranked.loss, F.cross_entropy(ranked.logits, torch.zeros(3, dtype=torch.long)))
