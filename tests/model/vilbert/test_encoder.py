"""Layer order (the release's t_biattention_id / v_biattention_id loop) and the co-attention math."""

from __future__ import annotations

import math

import torch

from model.vilbert import Vilbert, VilbertConfig
from model.vilbert.encoder import CoAttentionLayer, schedule


def test_base_order_matches_the_release():
    """bert_base_6layer_6conect: text 0-5, co 0, (text 6+k, visual k, co k+1) for k < 5, visual 5, text 11."""
    steps = schedule(VilbertConfig.preset("base"))
    expected = [("text", i) for i in range(6)] + [("co", 0)]
    for k in range(5):
        expected += [("text", 6 + k), ("vision", k), ("co", k + 1)]
    expected += [("vision", 5), ("text", 11)]
    assert steps == expected


def test_every_layer_runs_once_in_schedule_order(vb):
    cfg = vb.small_config()
    model = Vilbert(cfg).eval()
    ran = []
    for kind, layers in (
        ("text", model.encoder.layer),
        ("vision", model.encoder.v_layer),
        ("co", model.encoder.c_layer),
    ):
        for i, layer in enumerate(layers):
            layer.register_forward_hook(lambda *_, k=kind, i=i: ran.append((k, i)))
    with torch.no_grad():
        model(**vb.make_inputs(cfg))
    assert ran == schedule(cfg)
    assert sorted(ran) == sorted(
        [("text", i) for i in range(cfg.num_hidden_layers)]
        + [("vision", i) for i in range(cfg.v_num_hidden_layers)]
        + [("co", i) for i in range(cfg.num_co_layers)]
    )


def _attend(q, k, v, key_mask, heads):
    """Plain multi-head attention written out: softmax(q k^T / sqrt(d) - 10000 * padding) v."""
    b, sq, _ = q.shape
    split = lambda x: x.view(b, x.shape[1], heads, -1).transpose(1, 2)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + (1.0 - key_mask[:, None, None, :]) * -10000.0
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, sq, -1), scores.softmax(-1)


def test_co_attention_layer_against_the_written_out_math(vb):
    cfg = vb.small_config()
    layer = vb.perturb(CoAttentionLayer(cfg)).eval()
    g = torch.Generator().manual_seed(1)
    vision, text = (
        torch.randn(2, 4, cfg.v_hidden_size, generator=g),
        torch.randn(2, 6, cfg.hidden_size, generator=g),
    )
    v_mask, t_mask = torch.ones(2, 4), torch.ones(2, 6)
    v_mask[1, 3:] = 0
    t_mask[0, 4:] = 0
    with torch.no_grad():
        out_v, out_t, (t2v, v2t) = layer(
            vision, v_mask.bool()[:, None, None], text, t_mask.bool()[:, None, None], need_probs=True
        )
        a, o, h = layer.biattention, layer.biOutput, cfg.bi_num_attention_heads
        # Text queries (query2) read the regions (key1/value1); region queries (query1) read the text.
        text_ctx, ref_t2v = _attend(a.query2(text), a.key1(vision), a.value1(vision), v_mask, h)
        vision_ctx, ref_v2t = _attend(a.query1(vision), a.key2(text), a.value2(text), t_mask, h)
        v1 = o.LayerNorm1(vision + o.dense1(vision_ctx))
        t1 = o.LayerNorm2(text + o.dense2(text_ctx))
        gelu = torch.nn.functional.gelu
        ref_v = layer.v_output.LayerNorm(v1 + layer.v_output.dense(gelu(layer.v_intermediate.dense(v1))))
        ref_t = layer.t_output.LayerNorm(t1 + layer.t_output.dense(gelu(layer.t_intermediate.dense(t1))))
    torch.testing.assert_close(out_v, ref_v, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_t, ref_t, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(t2v, ref_t2v, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(v2t, ref_v2t, atol=1e-6, rtol=1e-5)
