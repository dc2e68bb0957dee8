"""VilbertConfig: presets, round trips and the checks on sizes and co-attention placement."""

from __future__ import annotations

import pytest

from model.vilbert import VilbertConfig


def test_base_is_bert_base_6layer_6conect():
    cfg = VilbertConfig.preset("base")
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size, cfg.num_hidden_layers) == (
        768,
        12,
        3072,
        12,
    )
    assert (
        cfg.v_hidden_size,
        cfg.v_num_attention_heads,
        cfg.v_intermediate_size,
        cfg.v_num_hidden_layers,
    ) == (
        1024,
        8,
        1024,
        6,
    )
    assert (cfg.bi_hidden_size, cfg.bi_num_attention_heads) == (1024, 8)
    assert cfg.v_biattention_id == [0, 1, 2, 3, 4, 5]
    assert cfg.t_biattention_id == [6, 7, 8, 9, 10, 11]
    assert (cfg.v_target_size, cfg.num_locs, cfg.fusion_method) == (1601, 5, "mul")


def test_round_trip_and_overrides():
    cfg = VilbertConfig.preset("tiny", hidden_dropout_prob=0.2)
    assert cfg.hidden_dropout_prob == 0.2
    assert VilbertConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"hiden_size": 8}, "unknown VilbertConfig field"),
        ({"bi_hidden_size": 30, "bi_num_attention_heads": 4}, "not whole"),
        ({"v_biattention_id": [0]}, "one entry per co-attention layer"),
        ({"t_biattention_id": [3, 2]}, "non-decreasing"),
        ({"t_biattention_id": [2, 9]}, "within 0..4"),
        ({"fusion_method": "concat"}, "fusion_method"),
        ({"task_token": 1}, "task table"),
    ],
)
def test_bad_configs_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        VilbertConfig.preset("tiny", **overrides)


def test_unknown_preset():
    with pytest.raises(ValueError, match="choose one of"):
        VilbertConfig.preset("large")
