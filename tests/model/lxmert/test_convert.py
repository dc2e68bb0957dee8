"""Conversion of release and HuggingFace LXMERT checkpoints to xmodal directories, and back."""

from __future__ import annotations

import logging
import pickle

import pytest
import torch

from model import Lxmert, LxmertForNLVR2, LxmertForPreTraining, LxmertForQuestionAnswering
from model.lxmert.convert import convert_lxmert, from_hf_state, to_hf_state
from model.row_order import MATCHED_INDEX


@pytest.fixture(scope="module")
def cfg(lx):
    return lx.small_config()


@pytest.fixture(scope="module")
def pretrained_dir(cfg, tmp_path_factory):
    torch.manual_seed(5)
    model = LxmertForPreTraining(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model, model.save_pretrained(tmp_path_factory.mktemp("pretrained"))


def test_release_pretraining_file_converts(pretrained_dir, tmp_path, lx, cfg):
    """A file in the original layout (DataParallel `module.` + `bert.`) becomes the same model."""
    model, _ = pretrained_dir
    hf_names = to_hf_state(model.state_dict(), cfg, "LxmertForPreTraining")
    release = {"module." + k.replace("lxmert.", "bert.", 1): v for k, v in hf_names.items()}
    torch.save(release, tmp_path / "Epoch20_LXRT.pth")
    out_dir = convert_lxmert(tmp_path / "Epoch20_LXRT.pth", tmp_path / "converted", num_attention_heads=4)
    converted = LxmertForPreTraining.from_pretrained(out_dir).eval()
    inputs = lx.make_inputs(cfg)
    with torch.no_grad():
        a, b = converted(**inputs), model(**inputs)
    for name in ("lm_logits", "matched_logits", "obj_logits", "attr_logits", "feat_pred", "answer_logits"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("task", ["vqa", "nlvr2"])
def test_release_finetuned_file_converts(pretrained_dir, tmp_path, cfg, task):
    """BEST.pth: `lxrt_encoder.model.module.bert.*` + a `logit_fc.*` head whose input size tells the task."""
    model, _ = pretrained_dir
    torch.manual_seed(6)
    finetuned = LxmertForQuestionAnswering(cfg, 9) if task == "vqa" else LxmertForNLVR2(cfg)
    finetuned.lxmert.load_state_dict(model.lxmert.state_dict())
    arch = type(finetuned).__name__
    hf_names = to_hf_state(finetuned.state_dict(), cfg, arch)
    release = {
        k.replace("lxmert.", "lxrt_encoder.model.module.bert.", 1).replace("answer_head.", ""): v
        for k, v in hf_names.items()
    }
    assert "logit_fc.3.weight" in release
    torch.save(release, tmp_path / "BEST.pth")
    loaded = type(finetuned).from_pretrained(convert_lxmert(tmp_path / "BEST.pth", tmp_path / "out"))
    for k, v in finetuned.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_unknown_and_missing_keys_are_named(pretrained_dir, cfg, caplog):
    model, _ = pretrained_dir
    hf_names = to_hf_state(model.state_dict(), cfg, "LxmertForPreTraining")
    extra = {**hf_names, "cls.something_new.weight": torch.zeros(1)}
    del extra["obj_predict_head.decoder_dict.attr.bias"]
    with caplog.at_level(logging.WARNING, logger="model.lxmert.convert"):
        ours = from_hf_state(extra, cfg, "LxmertForPreTraining")
    assert "cls.something_new.weight" in caplog.text and "decoder_dict.attr.bias" in caplog.text
    assert "object_head.attr.bias" not in ours
    del extra["lxmert.encoder.x_layers.1.visn_output.dense.weight"]
    with pytest.raises(ValueError, match=r"x_layers\.1\.visn_output\.dense\.weight"):
        from_hf_state(extra, cfg, "LxmertForPreTraining")


class _Payload:
    def __reduce__(self):
        return (print, ("code ran",))


def test_release_files_are_never_unpickled(tmp_path):
    path = tmp_path / "evil.pth"
    with open(path, "wb") as f:
        pickle.dump({"bert.embeddings.word_embeddings.weight": _Payload()}, f, protocol=2)
    with pytest.raises(ValueError, match="tensors-only"):
        convert_lxmert(path, tmp_path / "out")


def test_huggingface_directory_in_and_out(lx, cfg, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(7)
    hf = transformers.LxmertForPreTraining(lx.hf_config(cfg)).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = LxmertForPreTraining.from_pretrained(convert_lxmert(tmp_path / "hf", tmp_path / "ours")).eval()
    exported = convert_lxmert(tmp_path / "ours", tmp_path / "hf_again", to_hf=True)
    again = transformers.LxmertForPreTraining.from_pretrained(exported).eval()
    for k, v in hf.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
    inputs = lx.make_inputs(cfg)
    with torch.no_grad():
        out, ref = ours(**inputs), hf(**inputs)
    lx.close_where_real(out.lm_logits, ref.prediction_logits, lx.real(inputs)[0])
    # LXMERT's release and transformers' matched_label both say 1 = matched, as xmodal does: no swap
    torch.testing.assert_close(
        out.matched_logits.softmax(-1)[:, MATCHED_INDEX], ref.cross_relationship_score.softmax(-1)[:, 1]
    )
    assert from_hf_state(hf.state_dict(), cfg, "LxmertForPreTraining").keys() == ours.state_dict().keys()


def test_answer_table_size_is_checked_against_the_qa_head(pretrained_dir, cfg, tmp_path):
    _, directory = pretrained_dir
    rows = cfg.num_qa_labels
    assert (convert_lxmert(directory, tmp_path / "ok", num_answers=rows) / "model.safetensors").is_file()
    with pytest.raises(ValueError, match=rf"QA head has {rows} answers but the answer table {rows + 1}"):
        convert_lxmert(directory, tmp_path / "bad", num_answers=rows + 1)
    nlvr2 = LxmertForNLVR2.from_pretrained(directory).save_pretrained(tmp_path / "nlvr2")
    with pytest.raises(ValueError, match="LxmertForNLVR2 has no QA head"):
        convert_lxmert(nlvr2, tmp_path / "bad2", num_answers=rows)
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad2").exists()


def test_corrupt_safetensors_is_named(tmp_path):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text('{"model_type": "lxmert"}')
    (hf_dir / "model.safetensors").write_bytes(b"garbage" * 4)
    with pytest.raises(ValueError, match=r"model.safetensors: cannot be read as a safetensors file"):
        convert_lxmert(hf_dir, tmp_path / "out")


@pytest.mark.parametrize("prefix", ["", "module."])
def test_lxrt_encoder_save_file_converts_to_the_backbone(pretrained_dir, tmp_path, lx, cfg, prefix):
    """The release's `LXRTEncoder.save` writes `self.model.state_dict()` to `<name>_LXRT.pth`: the
    LXRTFeatureExtraction's `bert.*` keys only (with `module.` after `multi_gpu()`), no heads."""
    model, _ = pretrained_dir
    hf_names = to_hf_state(model.state_dict(), cfg, "LxmertForPreTraining")
    release = {
        prefix + k.replace("lxmert.", "bert.", 1): v for k, v in hf_names.items() if k.startswith("lxmert.")
    }
    assert release and all(k.startswith(prefix + "bert.") for k in release)
    torch.save(release, tmp_path / "BEST_LXRT.pth")
    out_dir = convert_lxmert(tmp_path / "BEST_LXRT.pth", tmp_path / "encoder", num_attention_heads=4)
    backbone = Lxmert.from_pretrained(out_dir).eval()
    for k, v in model.lxmert.state_dict().items():
        assert torch.equal(backbone.state_dict()[k], v), k
    inputs = lx.make_inputs(cfg)
    inputs.pop("labels", None)
    with torch.no_grad():
        a, b = backbone(**inputs), model.lxmert(**inputs)
    torch.testing.assert_close(a.pooled_output, b.pooled_output, atol=1e-6, rtol=1e-6)
