"""The LXMERT backbone: padding, attention maps, input checks, autocast and compile."""

from __future__ import annotations

import pytest
import torch

from model import Lxmert, LxmertForPreTraining


@pytest.fixture(scope="module")
def cfg(lx):
    return lx.small_config()


@pytest.fixture(scope="module")
def pretrain(cfg):
    torch.manual_seed(0)
    return LxmertForPreTraining(cfg).eval()


def test_padding_changes_nothing_for_real_tokens_and_boxes(cfg, lx):
    torch.manual_seed(1)
    model = Lxmert(cfg).eval()
    inputs = lx.make_inputs(cfg, batch=2, tokens=5, boxes=4)
    inputs["attention_mask"][:] = 1
    inputs["visual_attention_mask"] = None
    padded = {k: v.clone() if v is not None else None for k, v in inputs.items()}
    g = torch.Generator().manual_seed(9)
    padded["input_ids"] = torch.cat(
        [inputs["input_ids"], torch.randint(1, cfg.vocab_size, (2, 3), generator=g)], 1
    )
    padded["token_type_ids"] = torch.cat([inputs["token_type_ids"], torch.ones(2, 3, dtype=torch.long)], 1)
    padded["attention_mask"] = torch.cat([inputs["attention_mask"], torch.zeros(2, 3, dtype=torch.long)], 1)
    padded["visual_feats"] = torch.cat([inputs["visual_feats"], torch.randn(2, 2, cfg.visual_feat_dim)], 1)
    padded["visual_pos"] = torch.cat([inputs["visual_pos"], torch.rand(2, 2, 4)], 1)
    padded["visual_attention_mask"] = torch.cat([torch.ones(2, 4), torch.zeros(2, 2)], 1)
    with torch.no_grad():
        ref, out = model(**inputs), model(**padded)
    torch.testing.assert_close(out.language_output[:, :5], ref.language_output, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.vision_output[:, :4], ref.vision_output, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.pooled_output, ref.pooled_output, atol=1e-6, rtol=1e-5)
    # and the padding really is in play: without the mask the outputs move
    padded["attention_mask"] = None
    with torch.no_grad():
        unmasked = model(**padded)
    assert not torch.allclose(unmasked.pooled_output, ref.pooled_output, atol=1e-4)


def test_left_padding_is_refused(cfg, lx):
    """The pooler reads position 0 and padding has no state, so a left-padded row would pool nothing."""
    inputs = lx.make_inputs(cfg)
    inputs["attention_mask"] = inputs["attention_mask"].flip(1)
    with pytest.raises(ValueError, match="pad on the right"):
        Lxmert(cfg)(**inputs)


def test_cross_attention_maps_only_on_request(cfg, pretrain, lx):
    inputs = lx.make_inputs(cfg)
    with torch.no_grad():
        plain = pretrain.lxmert(**inputs)
        maps = pretrain.lxmert(**inputs, output_attentions=True)
    assert plain.attentions is None
    assert len(maps.attentions) == cfg.x_layers
    att = maps.attentions[0]
    assert att.shape == (3, cfg.num_attention_heads, 7, 5)
    torch.testing.assert_close(att.sum(-1), torch.ones(att.shape[:-1]))
    assert (att[-1, :, :, -2:] == 0).all()  # padded boxes get no attention
    torch.testing.assert_close(maps.pooled_output, plain.pooled_output)


def test_bad_visual_inputs_are_named(cfg, pretrain, lx):
    inputs = lx.make_inputs(cfg)
    inputs["visual_feats"] = inputs["visual_feats"][..., :-1]
    with pytest.raises(ValueError, match="visual_feat_dim"):
        pretrain(**inputs)


def test_bf16_autocast_step_runs(cfg, lx):
    """Mixed precision: the same code path under autocast (CPU here; CUDA in the same way)."""
    torch.manual_seed(5)
    model = LxmertForPreTraining(cfg).train()
    inputs = lx.make_inputs(cfg)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**inputs, **lx.make_labels(cfg, inputs))
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.slow
def test_torch_compile_matches_eager_and_trains(lx):
    """torch.compile (inductor; CPU here, CUDA the same way) gives the eager outputs and a finite step.

    One layer per encoder: each layer kind is compiled once, so compiling stays short on a busy machine."""
    torch.manual_seed(7)
    cfg = lx.small_config(l_layers=1, r_layers=1, x_layers=1)
    model = LxmertForPreTraining(cfg).eval()
    inputs = lx.make_inputs(cfg)
    labels = lx.make_labels(cfg, inputs)
    compiled = torch.compile(model)
    with torch.no_grad():
        eager, fast = model(**inputs, **labels), compiled(**inputs, **labels)
    torch.testing.assert_close(fast.loss, eager.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast.answer_logits, eager.answer_logits, atol=1e-5, rtol=1e-5)
    model.train()
    compiled(**inputs, **labels).loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
