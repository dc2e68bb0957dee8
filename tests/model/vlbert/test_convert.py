"""Fake jackroos/VL-BERT checkpoints, written in the release's layout, load with every name accounted for."""

from __future__ import annotations

import pytest
import torch

from model.vlbert import VlBert, VlBertConfig, VlBertForPreTraining, VlBertForQuestionAnswering
from model.vlbert.convert import read_release_file

CFG = {
    "vocab_size": 99,
    "hidden_size": 64,
    "num_attention_heads": 2,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "geometry_dim": 16,
    "max_position_embeddings": 40,
    "num_region_classes": 11,
}
DETECTOR = {  # a few of the end-to-end ResNet's weights, which xmodal has no use for
    "module.image_feature_extractor.backbone.conv1.weight": (4, 3, 7, 7),
    "module.image_feature_extractor.roi_head_feature_extractor.0.conv1.weight": (4, 4, 1, 1),
    "module.image_feature_extractor.head.0.0.conv1.weight": (4, 4, 1, 1),
}


def release_layout(cfg: VlBertConfig, kind: str, answers: int = 5) -> dict[str, tuple[int, ...]]:
    """Key -> shape of a release checkpoint (`ResNetVLBERT` for VQA, `...ForPretraining`), by hand."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    vl = "module.vlbert."
    keys = {
        vl + "word_embeddings.weight": (v, h),
        vl + "end_embedding.weight": (1, h),
        vl + "position_embeddings.weight": (cfg.max_position_embeddings, h),
        vl + "token_type_embeddings.weight": (3, h),
        "module.image_feature_extractor.obj_downsample.1.weight": (h, cfg.geometry_dim + 2048),
        "module.image_feature_extractor.obj_downsample.1.bias": (h,),
        "module.object_linguistic_embeddings.weight": (1, h),
        **DETECTOR,
    }
    for norm in ("embedding_LayerNorm", "visual_ln_text", "visual_ln_object"):
        keys[f"{vl}{norm}.weight"] = keys[f"{vl}{norm}.bias"] = (h,)
    for n in range(cfg.num_hidden_layers):
        layer = f"{vl}encoder.layer.{n}."
        for part, shape in (
            ("attention.self.query", (h, h)),
            ("attention.self.key", (h, h)),
            ("attention.self.value", (h, h)),
            ("attention.output.dense", (h, h)),
            ("intermediate.dense", (i, h)),
            ("output.dense", (h, i)),
        ):
            keys[layer + part + ".weight"], keys[layer + part + ".bias"] = shape, (shape[0],)
        for part in ("attention.output.LayerNorm", "output.LayerNorm"):
            keys[layer + part + ".weight"] = keys[layer + part + ".bias"] = (h,)
    if kind == "vqa":
        keys |= {
            "module.final_mlp.0.dense.weight": (h, h),
            "module.final_mlp.0.dense.bias": (h,),
            "module.final_mlp.0.LayerNorm.weight": (h,),
            "module.final_mlp.0.LayerNorm.bias": (h,),
            "module.final_mlp.2.weight": (answers, h),
            "module.final_mlp.2.bias": (answers,),
        }
    if kind == "pretrain":
        keys |= {
            vl + "mlm_head.predictions.bias": (v,),
            vl + "mlm_head.predictions.transform.dense.weight": (h, h),
            vl + "mlm_head.predictions.transform.dense.bias": (h,),
            vl + "mlm_head.predictions.transform.LayerNorm.weight": (h,),
            vl + "mlm_head.predictions.transform.LayerNorm.bias": (h,),
            vl + "mlm_head.predictions.decoder.weight": (v, h),
            vl + "mvrc_head.transform.dense.weight": (h, h),
            vl + "mvrc_head.transform.dense.bias": (h,),
            vl + "mvrc_head.region_cls_pred.weight": (cfg.num_region_classes, h),
            vl + "mvrc_head.region_cls_pred.bias": (cfg.num_region_classes,),
            vl + "relationsip_head.caption_image_relationship.weight": (2, h),  # sic, the release's name
            vl + "relationsip_head.caption_image_relationship.bias": (2,),
            vl + "pooler.dense.weight": (h, h),
            vl + "pooler.dense.bias": (h,),
            "module.object_mask_visual_embedding.weight": (1, 2048),
            "module.object_mask_word_embedding.weight": (1, h),
        }
    return keys


def write_release(path, layout: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {k: torch.randn(shape, generator=g) for k, shape in layout.items()}
    decoder = "module.vlbert.mlm_head.predictions.decoder.weight"
    if decoder in state:
        state[decoder] = state["module.vlbert.word_embeddings.weight"].clone()
    torch.save({"state_dict": state, "optimizer": {}}, path)
    return state


@pytest.mark.parametrize(
    ("kind", "cls"),
    [("vqa", VlBertForQuestionAnswering), ("pretrain", VlBertForPreTraining), ("bare", VlBert)],
)
def test_release_checkpoint_loads_with_exact_coverage(tmp_path, kind, cls):
    cfg = VlBertConfig.preset("tiny", **CFG)
    state = write_release(tmp_path / "vl-bert.model", release_layout(cfg, kind))
    model, report = read_release_file(tmp_path / "vl-bert.model", num_attention_heads=2)
    assert type(model) is cls
    classes = 11 if kind == "pretrain" else 1601  # only the MVRC head tells the class count
    expected = {**cfg.to_dict(), "visual_feat_dim": 2048, "num_region_classes": classes}
    assert model.config == VlBertConfig.from_dict(expected)
    assert report.missing == []
    unused = set(DETECTOR)
    if kind == "pretrain":
        unused |= {k for k in state if ".relationsip_head." in k or ".pooler." in k}
        assert report.tied == ["module.vlbert.mlm_head.predictions.decoder.weight"]
    assert set(report.unexpected) == unused
    assert set(report.loaded) | set(report.unexpected) | set(report.tied) == set(state)
    assert len(report.loaded) == len(model.state_dict())
    ours = model.state_dict()
    prefix = "" if kind == "bare" else "vlbert."
    assert torch.equal(
        ours[prefix + "obj_downsample.1.weight"],
        state["module.image_feature_extractor.obj_downsample.1.weight"],
    )
    assert torch.equal(
        ours[prefix + "encoder.layer.1.attention.self.key.bias"],
        state["module.vlbert.encoder.layer.1.attention.self.key.bias"],
    )
    if kind == "vqa":
        assert model.num_answers == 5
        assert torch.equal(ours["final_mlp.2.weight"], state["module.final_mlp.2.weight"])
    if kind == "pretrain":  # the release's background row 0 is the store's last class
        for p in ("weight", "bias"):
            release = state[f"module.vlbert.mvrc_head.region_cls_pred.{p}"]
            assert torch.equal(ours[f"mvrc_head.region_cls_pred.{p}"][-1], release[0])
            assert torch.equal(ours[f"mvrc_head.region_cls_pred.{p}"][:-1], release[1:])


def test_not_a_vlbert_file_is_named(tmp_path):
    torch.save(
        {"state_dict": {"bert.embeddings.word_embeddings.weight": torch.zeros(3, 4)}}, tmp_path / "x.pth"
    )
    with pytest.raises(ValueError, match=r"x\.pth: not a VL-BERT checkpoint"):
        read_release_file(tmp_path / "x.pth")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"junk\.pth: cannot be read"):
        read_release_file(tmp_path / "junk.pth")


def test_missing_backbone_weight_is_an_error(tmp_path):
    cfg = VlBertConfig.preset("tiny", **CFG)
    layout = release_layout(cfg, "vqa")
    del layout["module.vlbert.end_embedding.weight"]
    write_release(tmp_path / "cut.model", layout)
    with pytest.raises(ValueError, match="end_embedding"):
        read_release_file(tmp_path / "cut.model", num_attention_heads=2)


def test_convert_writes_a_directory_every_role_loads(tmp_path):
    from model import read_config
    from model.vlbert import VlBertForNLVR2, convert_vlbert

    cfg = VlBertConfig.preset("tiny", **CFG)
    state = write_release(tmp_path / "vqa.model", release_layout(cfg, "vqa", answers=7))
    directory = convert_vlbert(tmp_path / "vqa.model", tmp_path / "ours", num_attention_heads=2)
    assert read_config(directory)[0] == "VlBertForQuestionAnswering"
    qa = VlBertForQuestionAnswering.from_pretrained(directory)
    assert qa.num_answers == 7 and torch.equal(qa.final_mlp[2].bias, state["module.final_mlp.2.bias"])
    pair = VlBertForNLVR2.from_pretrained(directory)  # backbone reused, pair head fresh
    assert torch.equal(pair.vlbert.end_embedding.weight, state["module.vlbert.end_embedding.weight"])


def test_converted_region_head_names_the_store_class(tmp_path, vl):
    """The release's region classes are background-first, the store's background-last: the converted
    head scores a store distribution as the release's head scores the same distribution in its order."""
    cfg = VlBertConfig.preset("tiny", **CFG)
    state = write_release(tmp_path / "vl-bert.model", release_layout(cfg, "pretrain"))
    model, _ = read_release_file(tmp_path / "vl-bert.model", num_attention_heads=2)
    model.eval()
    vl.wake(model)
    release = VlBertForPreTraining(model.config).eval()
    as_released = model.state_dict()
    for p in ("weight", "bias"):
        as_released[f"mvrc_head.region_cls_pred.{p}"] = state[f"module.vlbert.mvrc_head.region_cls_pred.{p}"]
    release.load_state_dict(as_released)
    inputs = vl.make_inputs(model.config, seed=4)
    g = torch.Generator().manual_seed(1)
    classes = cfg.num_region_classes
    store = torch.rand(*inputs["visual_feats"].shape[:2], classes, generator=g).softmax(-1)  # background last
    released = torch.cat([store[..., -1:], store[..., :-1]], dim=-1)  # the same, background first
    mask = torch.zeros(store.shape[:2], dtype=torch.long)
    mask[:, 1] = 1
    with torch.no_grad():
        ours = model(**inputs, region_mask=mask, region_probs=store)
        theirs = release(**inputs, region_mask=mask, region_probs=released)
    torch.testing.assert_close(ours.losses["mvrc"], theirs.losses["mvrc"])
    assert torch.equal(ours.region_logits.argmax(-1), (theirs.region_logits.argmax(-1) - 1) % classes)
