"""Files in the original LXMERT release layout convert to a model that matches transformers' LXMERT.

The release file is written from transformers' own state dict with the release's names (`bert.` for
`lxmert.`, with or without DataParallel's `module.`), so the reference and the conversion share no code.
"""

from __future__ import annotations

import pytest
import torch

from model import LxmertConfig, LxmertForPreTraining
from model.lxmert.convert import convert_lxmert

transformers = pytest.importorskip("transformers")


def _release_names(state: dict[str, torch.Tensor], data_parallel: bool) -> dict[str, torch.Tensor]:
    prefix = "module." if data_parallel else ""
    return {prefix + k.replace("lxmert.", "bert.", 1): v for k, v in state.items()}


@pytest.mark.parametrize(
    ("size", "data_parallel"),
    [("small", True), ("small", False), pytest.param("base", True, marks=pytest.mark.slow)],
)
def test_release_file_matches_transformers(size, data_parallel, lx, tmp_path):
    # The small config has 8-wide heads; release files carry no config, so the head count is passed
    # as a user would. At the base size it is inferred (hidden / 64).
    cfg = lx.small_config() if size == "small" else LxmertConfig.preset("base")
    heads = cfg.num_attention_heads if size == "small" else None
    torch.manual_seed(11)
    hf = transformers.LxmertForPreTraining(lx.hf_config(cfg)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    name = "Epoch20_LXRT.pth" if data_parallel else "model_LXRT.pth"
    torch.save(_release_names(hf.state_dict(), data_parallel), tmp_path / name)

    ours = LxmertForPreTraining.from_pretrained(
        convert_lxmert(tmp_path / name, tmp_path / "converted", num_attention_heads=heads)
    ).eval()
    assert ours.config.num_attention_heads == cfg.num_attention_heads

    inputs = lx.make_inputs(cfg, batch=2, tokens=6, boxes=4, seed=4)
    with torch.no_grad():
        ref = hf(**inputs)
        ref_backbone = hf.lxmert(**inputs)
        ref_obj = hf.obj_predict_head(ref_backbone.vision_output)
        out = ours(**inputs)
    tokens, boxes = lx.real(inputs)
    pairs = {  # field: (ours, transformers', the positions compared)
        "language_output": (out.language_output, ref_backbone.language_output, tokens),
        "vision_output": (out.vision_output, ref_backbone.vision_output, boxes),
        "pooled_output": (out.pooled_output, ref_backbone.pooled_output, ...),
        "lm_logits": (out.lm_logits, ref.prediction_logits, tokens),
        "matched_logits": (out.matched_logits, ref.cross_relationship_score, ...),
        "answer_logits": (out.answer_logits, ref.question_answering_score, ...),
        "obj_logits": (out.obj_logits, ref_obj["obj"], boxes),
        "attr_logits": (out.attr_logits, ref_obj["attr"], boxes),
        "feat_pred": (out.feat_pred, ref_obj["feat"], boxes),
    }
    for field, (mine, theirs, where) in pairs.items():
        assert mine.shape == theirs.shape, field
        torch.testing.assert_close(mine[where], theirs[where], atol=1e-5, rtol=1e-5, msg=field)
