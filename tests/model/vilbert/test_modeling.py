"""The backbone: output shapes, pooled fusion, and padding that cannot change real positions."""

from __future__ import annotations

import pytest
import torch

from model.vilbert import Vilbert


@pytest.fixture(scope="module")
def setup(vb):
    cfg = vb.small_config()
    torch.manual_seed(0)
    return cfg, vb.perturb(Vilbert(cfg)).eval(), vb.make_inputs(cfg)


def test_shapes_and_fusion(setup):
    cfg, model, inputs = setup
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    b, length = inputs["input_ids"].shape
    n = inputs["visual_feats"].shape[1]
    assert out.text_output.shape == (b, length, cfg.hidden_size)
    assert out.vision_output.shape == (b, n + 1, cfg.v_hidden_size)  # the global token first
    assert out.pooled_output.shape == (b, cfg.bi_hidden_size)
    torch.testing.assert_close(out.pooled_output, out.pooled_text * out.pooled_vision)
    torch.testing.assert_close(out.pooled_text, torch.relu(model.t_pooler.dense(out.text_output[:, 0])))
    torch.testing.assert_close(out.pooled_vision, torch.relu(model.v_pooler.dense(out.vision_output[:, 0])))
    assert len(out.co_attentions) == cfg.num_co_layers
    t2v, v2t = out.co_attentions[-1]
    assert t2v.shape == (b, cfg.bi_num_attention_heads, length, n + 1)
    assert v2t.shape == (b, cfg.bi_num_attention_heads, n + 1, length)
    # Padding regions (last row) and padding tokens (row 1) get no weight.
    assert t2v[-1, :, :, -2:].abs().max() == 0
    assert v2t[1, :, :, -3:].abs().max() == 0


def test_padding_does_not_change_real_positions(setup):
    cfg, model, inputs = setup
    with torch.no_grad():
        batched = model(**inputs)
        for row in range(inputs["input_ids"].shape[0]):
            tokens = int(inputs["attention_mask"][row].sum())
            boxes = int(inputs["visual_attention_mask"][row].sum())
            alone = model(
                inputs["input_ids"][row : row + 1, :tokens],
                None,
                inputs["token_type_ids"][row : row + 1, :tokens],
                inputs["visual_feats"][row : row + 1, :boxes],
                inputs["visual_pos"][row : row + 1, :boxes],
                None,
            )
            kw = {"atol": 2e-5, "rtol": 1e-4}
            torch.testing.assert_close(batched.text_output[row, :tokens], alone.text_output[0], **kw)
            torch.testing.assert_close(batched.vision_output[row, : boxes + 1], alone.vision_output[0], **kw)
            torch.testing.assert_close(batched.pooled_output[row], alone.pooled_output[0], **kw)


def test_values_at_padding_are_ignored(setup):
    cfg, model, inputs = setup
    noisy = dict(inputs)
    noisy["visual_feats"] = inputs["visual_feats"].clone()
    noisy["visual_feats"][-1, -2:] = 1e3
    noisy["input_ids"] = inputs["input_ids"].clone()
    noisy["input_ids"][1, -3:] = 1
    with torch.no_grad():
        a, b = model(**inputs), model(**noisy)
    torch.testing.assert_close(a.pooled_output, b.pooled_output)


def test_bad_inputs_are_refused_in_one_line(setup):
    cfg, model, inputs = setup
    with pytest.raises(ValueError, match="needs visual_feats"):
        model(inputs["input_ids"])
    with pytest.raises(ValueError, match="visual_feat_dim"):
        model(**{**inputs, "visual_feats": inputs["visual_feats"][..., :-1]})
    left = inputs["attention_mask"].clone()
    left[0, 0] = 0
    with pytest.raises(ValueError, match="pad on the right"):
        model(**{**inputs, "attention_mask": left})


def test_task_token_keeps_the_text_length(vb):
    cfg = vb.small_config(task_vocab_size=3, task_token=1)
    model = Vilbert(cfg).eval()
    inputs = vb.make_inputs(cfg)
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    assert out.text_output.shape[1] == inputs["input_ids"].shape[1]
    assert out.co_attentions[0][0].shape[2] == inputs["input_ids"].shape[1]
    assert out.co_attentions[0][1].shape[3] == inputs["input_ids"].shape[1]
