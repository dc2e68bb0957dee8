"""Conversion of fake released files, written here from each layout's own naming rules."""

from __future__ import annotations

import json

import pytest
import torch

from model.row_order import MATCHED_INDEX
from model.vilbert import Vilbert, VilbertConfig, VilbertForPreTraining, VilbertForQuestionAnswering
from model.vilbert.convert import ConversionReport, config_from_reference, convert_vilbert, load_release

Shapes = dict[str, tuple[int, ...]]


def _lin(keys: Shapes, name: str, i: int, o: int) -> None:
    keys[f"{name}.weight"], keys[f"{name}.bias"] = (o, i), (o,)


def _ln(keys: Shapes, name: str, d: int) -> None:
    keys[f"{name}.weight"], keys[f"{name}.bias"] = (d,), (d,)


def _embeddings_and_poolers(keys: Shapes, cfg: VilbertConfig) -> None:
    h, v, b = cfg.hidden_size, cfg.v_hidden_size, cfg.bi_hidden_size
    keys["bert.embeddings.word_embeddings.weight"] = (cfg.vocab_size, h)
    keys["bert.embeddings.position_embeddings.weight"] = (cfg.max_position_embeddings, h)
    keys["bert.embeddings.token_type_embeddings.weight"] = (cfg.type_vocab_size, h)
    _ln(keys, "bert.embeddings.LayerNorm", h)
    _lin(keys, "bert.v_embeddings.image_embeddings", cfg.visual_feat_dim, v)
    _lin(keys, "bert.v_embeddings.image_location_embeddings", 5, v)
    _ln(keys, "bert.v_embeddings.LayerNorm", v)
    _lin(keys, "bert.t_pooler.dense", h, b)
    _lin(keys, "bert.v_pooler.dense", v, b)


def _pretraining_heads(keys: Shapes, cfg: VilbertConfig, image_decoder: str) -> None:
    h, v = cfg.hidden_size, cfg.v_hidden_size
    _lin(keys, "cls.predictions.transform.dense", h, h)
    _ln(keys, "cls.predictions.transform.LayerNorm", h)
    keys["cls.predictions.bias"] = (cfg.vocab_size,)
    keys["cls.predictions.decoder.weight"] = (cfg.vocab_size, h)
    _lin(keys, "cls.bi_seq_relationship", cfg.bi_hidden_size, 2)
    _lin(keys, "cls.imagePredictions.transform.dense", v, v)
    _ln(keys, "cls.imagePredictions.transform.LayerNorm", v)
    _lin(keys, f"cls.imagePredictions.{image_decoder}", v, cfg.v_target_size)


def release_keys(cfg: VilbertConfig, multi_task: bool) -> Shapes:
    """vilbert-multi-task: BertForMultiModalPreTraining, or VILBertForVLTasks with every task head."""
    h, v, b = cfg.hidden_size, cfg.v_hidden_size, cfg.bi_hidden_size
    keys: Shapes = {}
    _embeddings_and_poolers(keys, cfg)
    for stream, n, d, inner in (
        ("layer", cfg.num_hidden_layers, h, cfg.intermediate_size),
        ("v_layer", cfg.v_num_hidden_layers, v, cfg.v_intermediate_size),
    ):
        for i in range(n):
            p = f"bert.encoder.{stream}.{i}"
            for m in ("query", "key", "value"):
                _lin(keys, f"{p}.attention.self.{m}", d, d)
            _lin(keys, f"{p}.attention.output.dense", d, d)
            _ln(keys, f"{p}.attention.output.LayerNorm", d)
            _lin(keys, f"{p}.intermediate.dense", d, inner)
            _lin(keys, f"{p}.output.dense", inner, d)
            _ln(keys, f"{p}.output.LayerNorm", d)
    for k in range(cfg.num_co_layers):
        p = f"bert.encoder.c_layer.{k}"
        for m in ("query", "key", "value"):
            _lin(keys, f"{p}.biattention.{m}1", v, b)
            _lin(keys, f"{p}.biattention.{m}2", h, b)
        for side, d in (("1", v), ("2", h)):
            _lin(keys, f"{p}.biOutput.dense{side}", b, d)
            _ln(keys, f"{p}.biOutput.LayerNorm{side}", d)
            _lin(keys, f"{p}.biOutput.q_dense{side}", b, d)
        _lin(keys, f"{p}.v_intermediate.dense", v, cfg.v_intermediate_size)
        _lin(keys, f"{p}.v_output.dense", cfg.v_intermediate_size, v)
        _ln(keys, f"{p}.v_output.LayerNorm", v)
        _lin(keys, f"{p}.t_intermediate.dense", h, cfg.intermediate_size)
        _lin(keys, f"{p}.t_output.dense", cfg.intermediate_size, h)
        _ln(keys, f"{p}.t_output.LayerNorm", h)
    _pretraining_heads(keys, cfg, "decoder")
    if multi_task:
        keys["bert.embeddings.task_embeddings.weight"] = (20, h)
        for name, inp, out in (
            ("vil_prediction", b, 9),
            ("vil_prediction_gqa", b, 7),
            ("vil_binary_prediction", 2 * b, 2),
        ):
            _lin(keys, f"{name}.logit_fc.0", inp, 2 * b)
            _ln(keys, f"{name}.logit_fc.2", 2 * b)
            _lin(keys, f"{name}.logit_fc.3", 2 * b, out)
        _lin(keys, "vil_logit", b, 1)
        _lin(keys, "vil_tri_prediction", b, 3)
        _lin(keys, "vision_logit", v, 1)
        _lin(keys, "linguisic_logit", h, 1)
    return keys


def volta_config(cfg: VilbertConfig) -> dict:
    """volta's config for the small model, in vilbert_base.json's form: t0 | co0 | t1+v0 | co1 | t2+v1."""
    b = str(cfg.bi_hidden_size)
    return {
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "v_feature_size": cfg.visual_feat_dim,
        "v_hidden_size": cfg.v_hidden_size,
        "v_num_attention_heads": cfg.v_num_attention_heads,
        "v_intermediate_size": cfg.v_intermediate_size,
        "pooler_size": cfg.bi_hidden_size,
        "fusion_method": "mul",
        "tt_attn_sublayers": [0, 4, 8],
        "tv_attn_sublayers": [2, 6],
        "vt_attn_sublayers": [2, 6],
        "vv_attn_sublayers": [4, 8],
        "t_ff_sublayers": [1, 3, 5, 7, 9],
        "v_ff_sublayers": [3, 5, 7, 9],
        "sublayer2attn_hidden_size": {"2": int(b), "6": int(b)},
        "sublayer2num_attention_heads": {"2": cfg.bi_num_attention_heads, "6": cfg.bi_num_attention_heads},
    }


def volta_keys(cfg: VilbertConfig, vc: dict) -> Shapes:
    """volta's BertForVLPreTraining names: sublayer n carries a text part and/or a visual part."""
    h, v = cfg.hidden_size, cfg.v_hidden_size
    keys: Shapes = {}
    _embeddings_and_poolers(keys, cfg)
    for n in range(10):
        p = f"bert.encoder.layer.{n}"
        if n % 2 == 0:
            attn = vc["sublayer2attn_hidden_size"].get(str(n), h)
            if n in vc["tt_attn_sublayers"] or n in vc["tv_attn_sublayers"]:
                for m in ("query", "key", "value"):
                    _lin(keys, f"{p}.attention_self.{m}", h, attn)
                _lin(keys, f"{p}.attention_output.dense", attn, h)
                _ln(keys, f"{p}.attention_output.LayerNorm", h)
            if n in vc["vv_attn_sublayers"] or n in vc["vt_attn_sublayers"]:
                for m in ("query", "key", "value"):
                    _lin(keys, f"{p}.attention_self.v_{m}", v, v)
                _lin(keys, f"{p}.attention_output.v_dense", v, v)
                _ln(keys, f"{p}.attention_output.v_LayerNorm", v)
        else:
            if n in vc["t_ff_sublayers"]:
                _lin(keys, f"{p}.intermediate.dense", h, cfg.intermediate_size)
                _lin(keys, f"{p}.output.dense", cfg.intermediate_size, h)
                _ln(keys, f"{p}.output.LayerNorm", h)
            if n in vc["v_ff_sublayers"]:
                _lin(keys, f"{p}.intermediate.v_dense", v, cfg.v_intermediate_size)
                _lin(keys, f"{p}.output.v_dense", cfg.v_intermediate_size, v)
                _ln(keys, f"{p}.output.v_LayerNorm", v)
    _pretraining_heads(keys, cfg, "decoder_dict.0")
    _lin(keys, "cls.imagePredictions.decoder_dict.2", v, 4)  # a volta visual target ViLBERT lacks
    _lin(keys, "clfs_dict.TASK1.logit_fc.0", cfg.bi_hidden_size, 5)
    return keys


def write(path, shapes: Shapes, prefix: str = "") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    torch.save({prefix + k: t for k, t in state.items()}, path)
    return state


def _convert(src, dst, **kwargs) -> ConversionReport:
    """The report of `load_release`, and the directory `convert_vilbert` writes."""
    _, report = load_release(src, **kwargs)
    assert convert_vilbert(src, dst, **kwargs) == dst
    return report


@pytest.fixture
def cfg(vb):
    return vb.small_config()


def test_pretrained_model_bin_converts_every_name(cfg, tmp_path):
    shapes = release_keys(cfg, multi_task=False)
    state = write(tmp_path / "pretrained_model.bin", shapes)
    report = _convert(
        tmp_path / "pretrained_model.bin",
        tmp_path / "out",
        preset="tiny",
        config_file=_small_json(cfg, tmp_path),
    )
    assert (
        report.ok and report.architecture == "VilbertForPreTraining" and report.layout == "vilbert-multi-task"
    )
    dropped = {k for k in shapes if ".q_dense" in k} | {"cls.predictions.decoder.weight"}
    assert set(report.dropped) == dropped
    assert sorted(report.converted) == sorted(set(shapes) - dropped)
    named = report.summary(dropped=True).splitlines()[1:]  # `convert -v`: one line per dropped weight
    assert sorted(line.split(":")[0].removeprefix("  dropped ") for line in named) == sorted(dropped)
    assert len(report.summary().splitlines()) == 1
    model = VilbertForPreTraining.from_pretrained(tmp_path / "out")
    own = model.state_dict()
    assert set(own) == set(shapes) - dropped  # our names are the release's names
    for k in own:
        if not k.startswith(("cls.bi_seq_relationship.", "cls.imagePredictions.decoder.")):
            assert torch.equal(own[k], state[k]), k
    for p in ("weight", "bias"):
        # the release's "matched" row 0 is our row 1; its background row 0 is our last row
        match, region = f"cls.bi_seq_relationship.{p}", f"cls.imagePredictions.decoder.{p}"
        assert torch.equal(own[match][1], state[match][0]) and torch.equal(own[match][0], state[match][1])
        assert torch.equal(own[region][-1], state[region][0])
        assert torch.equal(own[region][:-1], state[region][1:])


def _small_json(cfg: VilbertConfig, tmp_path) -> str:
    """The small config written as vilbert-multi-task's JSON (its own keys, plus ones we ignore)."""
    values = {k: v for k, v in cfg.to_dict().items() if not k.startswith(("task", "classifier", "fusion"))}
    values["v_feature_size"] = values.pop("visual_feat_dim")
    values |= {
        "hidden_act": "gelu",
        "bi_intermediate_size": 7,
        "pooling_method": "mul",
        "bi_attention_type": 1,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    return str(path)


def test_multi_task_model_bin_with_the_gqa_head_and_task_token(cfg, tmp_path):
    shapes = release_keys(cfg, multi_task=True)
    state = write(tmp_path / "multi_task_model.bin", shapes, prefix="module.")
    report = _convert(
        tmp_path / "multi_task_model.bin",
        tmp_path / "out",
        config_file=_small_json(cfg, tmp_path),
        head="gqa",
        task_token=1,
    )
    assert report.ok and report.architecture == "VilbertForQuestionAnswering"
    heads = (
        "cls.",
        "vil_prediction.",
        "vil_binary",
        "vil_logit",
        "vil_tri",
        "vision_logit",
        "linguisic_logit",
    )
    assert all(k.startswith(heads) or ".q_dense" in k for k in report.dropped)
    assert len(report.converted) + len(report.dropped) == len(shapes)
    model = VilbertForQuestionAnswering.from_pretrained(tmp_path / "out")
    assert model.num_answers == 7 and model.config.task_token == 1 and model.config.task_vocab_size == 20
    own = model.state_dict()
    assert torch.equal(own["vil_prediction.logit_fc.3.weight"], state["vil_prediction_gqa.logit_fc.3.weight"])
    assert torch.equal(
        own["bert.embeddings.task_embeddings.weight"], state["bert.embeddings.task_embeddings.weight"]
    )
    # The default head of a multi-task file is VQA's.
    vqa = _convert(
        tmp_path / "multi_task_model.bin", tmp_path / "vqa", config_file=_small_json(cfg, tmp_path)
    )
    assert vqa.ok and VilbertForQuestionAnswering.from_pretrained(tmp_path / "vqa").num_answers == 9
    backbone = _convert(
        tmp_path / "multi_task_model.bin",
        tmp_path / "bb",
        config_file=_small_json(cfg, tmp_path),
        head="backbone",
    )
    assert backbone.ok and set(Vilbert.from_pretrained(tmp_path / "bb").state_dict()) == {
        k[len("bert.") :] for k in shapes if k.startswith("bert.") and ".q_dense" not in k
    }


def test_volta_sublayers_map_onto_layers_and_co_attention(vb, tmp_path):
    # volta's co-attention needs bi == visual width; its region classes are fixed at 1601
    cfg = vb.small_config(bi_hidden_size=16, v_target_size=1601)
    vc = volta_config(cfg)
    (tmp_path / "vilbert_base.json").write_text(json.dumps(vc))
    shapes = volta_keys(cfg, vc)
    state = write(tmp_path / "volta.bin", shapes)
    report = _convert(
        tmp_path / "volta.bin", tmp_path / "out", preset="tiny", config_file=tmp_path / "vilbert_base.json"
    )
    assert report.ok and report.layout == "volta", report.summary()
    assert set(report.dropped) == {
        "cls.predictions.decoder.weight",
        "cls.imagePredictions.decoder_dict.2.weight",
        "cls.imagePredictions.decoder_dict.2.bias",
        "clfs_dict.TASK1.logit_fc.0.weight",
        "clfs_dict.TASK1.logit_fc.0.bias",
    }
    model = VilbertForPreTraining.from_pretrained(tmp_path / "out")
    assert model.config.t_biattention_id == [1, 2] and model.config.v_biattention_id == [0, 1]
    own = model.state_dict()
    assert len(own) == len(report.converted)
    e = "bert.encoder."
    pairs = {
        "layer.0.attention.self.query.weight": "layer.0.attention_self.query.weight",
        "c_layer.0.biattention.query2.weight": "layer.2.attention_self.query.weight",
        "c_layer.0.biattention.value1.bias": "layer.2.attention_self.v_value.bias",
        "c_layer.1.biOutput.dense1.weight": "layer.6.attention_output.v_dense.weight",
        "c_layer.1.biOutput.LayerNorm2.weight": "layer.6.attention_output.LayerNorm.weight",
        "c_layer.0.t_output.dense.weight": "layer.3.output.dense.weight",
        "c_layer.0.v_intermediate.dense.weight": "layer.3.intermediate.v_dense.weight",
        "layer.1.attention.self.key.weight": "layer.4.attention_self.key.weight",
        "v_layer.0.attention.self.key.weight": "layer.4.attention_self.v_key.weight",
        "v_layer.1.output.LayerNorm.bias": "layer.9.output.v_LayerNorm.bias",
        "layer.2.intermediate.dense.weight": "layer.9.intermediate.dense.weight",
    }
    for ours, theirs in pairs.items():
        assert torch.equal(own[e + ours], state[e + theirs]), ours
    decoder = "cls.imagePredictions.decoder"
    release = state[f"{decoder}_dict.0.weight"]  # background first, as the store's is last
    assert torch.equal(own[f"{decoder}.weight"], torch.cat([release[1:], release[:1]]))


def test_released_configs_give_the_base_preset():
    """The values of bert_base_6layer_6conect.json and of volta's vilbert_base.json sublayer lists."""
    release = {
        "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
        "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 3072,
        "max_position_embeddings": 512,
        "num_attention_heads": 12, "num_hidden_layers": 12, "type_vocab_size": 2, "vocab_size": 30522,
        "visual_feat_dim": 2048, "v_target_size": 1601, "v_hidden_size": 1024, "v_num_hidden_layers": 6,
        "v_num_attention_heads": 8, "v_intermediate_size": 1024, "bi_hidden_size": 1024,
        "bi_num_attention_heads": 8, "bi_intermediate_size": 1024, "bi_attention_type": 1,
        "v_attention_probs_dropout_prob": 0.1, "v_hidden_act": "gelu", "v_hidden_dropout_prob": 0.1,
        "v_initializer_range": 0.02, "v_biattention_id": [0, 1, 2, 3, 4, 5],
        "t_biattention_id": [6, 7, 8, 9, 10, 11], "pooling_method": "mul",
    }  # fmt: skip
    base = VilbertConfig.preset("base")
    assert VilbertConfig.preset("base", **config_from_reference(release)) == base
    co = [12, 16, 20, 24, 28, 32]
    volta = {
        "hidden_size": 768, "num_attention_heads": 12, "v_hidden_size": 1024, "pooler_size": 1024,
        "tt_attn_sublayers": [0, 2, 4, 6, 8, 10, 14, 18, 22, 26, 30, 34], "tv_attn_sublayers": co,
        "vt_attn_sublayers": co, "vv_attn_sublayers": [14, 18, 22, 26, 30, 34],
        "sublayer2attn_hidden_size": {str(n): 1024 for n in co},
        "sublayer2num_attention_heads": {str(n): 8 for n in co},
    }  # fmt: skip
    assert (
        VilbertConfig.preset("tiny", **config_from_reference(volta)).t_biattention_id == base.t_biattention_id
    )
    assert VilbertConfig.preset("base", **config_from_reference(volta)) == base


def test_every_problem_is_reported_and_strict_refuses(cfg, tmp_path):
    shapes = release_keys(cfg, multi_task=False)
    del shapes["bert.encoder.layer.0.output.dense.bias"]
    shapes["bert.encoder.c_layer.0.biattention.logit1.weight"] = (2, 3)
    shapes["cls.bi_seq_relationship.weight"] = (3, cfg.bi_hidden_size)
    write(tmp_path / "bad.bin", shapes)
    config = _small_json(cfg, tmp_path)
    with pytest.raises(ValueError) as err:
        convert_vilbert(tmp_path / "bad.bin", tmp_path / "out", config_file=config)
    message = str(err.value)
    for name in ("layer.0.output.dense.bias", "biattention.logit1.weight", "cls.bi_seq_relationship.weight"):
        assert name in message
    assert not (tmp_path / "out").exists()
    report = _convert(tmp_path / "bad.bin", tmp_path / "out", config_file=config, strict=False)
    assert report.missing == ["bert.encoder.layer.0.output.dense.bias", "cls.bi_seq_relationship.weight"]
    assert report.unexpected == ["bert.encoder.c_layer.0.biattention.logit1.weight"]
    assert report.mis_shaped == [
        f"cls.bi_seq_relationship.weight: file (3, {cfg.bi_hidden_size}) vs model (2, {cfg.bi_hidden_size})"
    ]
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_unreadable_files_fail_in_one_line(tmp_path):
    torch.save(
        {"weights": {"a": torch.zeros(1)}, "epoch": 3, "optimizer": object()}, tmp_path / "pickled.bin"
    )
    with pytest.raises(ValueError, match="tensors-only checkpoint"):
        convert_vilbert(tmp_path / "pickled.bin", tmp_path / "out")
    torch.save({"bert.embeddings.word_embeddings.weight": torch.zeros(2, 2)}, tmp_path / "other.bin")
    with pytest.raises(ValueError, match="no ViLBERT backbone"):
        convert_vilbert(tmp_path / "other.bin", tmp_path / "out")
    with pytest.raises(FileNotFoundError):
        convert_vilbert(tmp_path / "missing.bin", tmp_path / "out")


def _release_model(cfg: VilbertConfig, state: dict[str, torch.Tensor]) -> VilbertForPreTraining:
    """The release's network: our modules with the file's rows as they are (its forward equals ours, so
    this scores as the release does, with "matched" at row 0 and the background class first)."""
    model = VilbertForPreTraining(cfg)
    own = model.state_dict()
    model.load_state_dict({k: v for k, v in state.items() if k in own and v.shape == own[k].shape})
    return model.eval()


@pytest.mark.parametrize("layout", ["vilbert-multi-task", "volta"])
def test_converted_release_keeps_the_meaning_of_matching_and_region_classes(vb, tmp_path, layout):
    if layout == "volta":
        cfg = vb.small_config(bi_hidden_size=16, v_target_size=1601)
        vc = volta_config(cfg)
        config = tmp_path / "vilbert_base.json"
        config.write_text(json.dumps(vc))
        state = write(tmp_path / "release.bin", volta_keys(cfg, vc))
    else:
        cfg = vb.small_config()
        config = _small_json(cfg, tmp_path)
        state = write(tmp_path / "release.bin", release_keys(cfg, multi_task=False))
    model, report = load_release(tmp_path / "release.bin", preset="tiny", config_file=config)
    assert report.ok, report.summary()
    model.eval()
    # the release's head, named as ours, on the same backbone
    ours = model.state_dict()
    release_state = dict(ours)
    for p in ("weight", "bias"):
        decoder = "decoder_dict.0" if layout == "volta" else "decoder"
        release_state[f"cls.bi_seq_relationship.{p}"] = state[f"cls.bi_seq_relationship.{p}"]
        release_state[f"cls.imagePredictions.decoder.{p}"] = state[f"cls.imagePredictions.{decoder}.{p}"]
    release = _release_model(cfg, release_state)
    inputs = vb.make_inputs(cfg, batch=4, seed=5)
    with torch.no_grad():
        theirs, out = release(**inputs), model(**inputs)
    p_release = theirs.matched_logits.softmax(-1)[:, 0]  # concept_cap_dataset.py: is_next 0 = matched
    p_ours = out.matched_logits.softmax(-1)[:, MATCHED_INDEX]
    torch.testing.assert_close(p_ours, p_release)
    assert torch.equal(p_ours.argsort(), p_release.argsort())  # retrieval ranks the pairs alike
    # a store distribution (background last) and the release's target for it (background first)
    g = torch.Generator().manual_seed(1)
    store = torch.rand(4, inputs["visual_feats"].shape[1], cfg.v_target_size, generator=g).softmax(-1)
    release_target = torch.cat([store[..., -1:], store[..., :-1]], dim=-1)
    region_mask = torch.ones(store.shape[:2], dtype=torch.long)
    with torch.no_grad():
        ours_loss = model(**inputs, region_mask=region_mask, region_probs=store).losses["region"]
        their_loss = release(**inputs, region_mask=region_mask, region_probs=release_target).losses["region"]
    torch.testing.assert_close(ours_loss, their_loss)
    # the class each head names: the release's argmax r is the store's class (r - 1) mod C
    picked = inputs["visual_attention_mask"].bool()
    their_class = (theirs.region_logits[picked].argmax(-1) - 1) % cfg.v_target_size
    assert torch.equal(out.region_logits[picked].argmax(-1), their_class)
