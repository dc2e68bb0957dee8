"""save_pretrained / from_pretrained, across classes; conversion of release and HuggingFace checkpoints."""

from __future__ import annotations

import logging
import pickle

import pytest
import torch

from model import Lxmert, LxmertForNLVR2, LxmertForPreTraining, LxmertForQuestionAnswering
from model.convert import convert_lxmert, from_hf_state, to_hf_state


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


def _backbone_equal(a: Lxmert, b: Lxmert) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_save_load_round_trip(pretrained_dir, lx, cfg):
    model, directory = pretrained_dir
    assert {p.name for p in directory.iterdir()} == {"config.json", "model.safetensors"}
    loaded = LxmertForPreTraining.from_pretrained(directory).eval()
    assert loaded.config == model.config
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    inputs = lx.make_inputs(cfg)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).answer_logits, model(**inputs).answer_logits)
    assert (
        LxmertForPreTraining.from_pretrained(directory, hidden_dropout_prob=0.3).config.hidden_dropout_prob
        == 0.3
    )


def test_any_class_loads_any_directory(pretrained_dir, tmp_path, caplog):
    model, directory = pretrained_dir
    backbone = Lxmert.from_pretrained(directory)
    _backbone_equal(backbone, model.lxmert)

    with caplog.at_level(logging.WARNING, logger="model.checkpoint"):
        qa = LxmertForQuestionAnswering.from_pretrained(directory, num_answers=7)
    _backbone_equal(qa.lxmert, model.lxmert)
    assert qa.answer_head.classifier.out_features == 7 and "answer_head.classifier.weight" in caplog.text

    qa_dir = qa.save_pretrained(tmp_path / "qa")
    again = LxmertForQuestionAnswering.from_pretrained(qa_dir)  # num_answers comes from the directory
    assert torch.equal(again.answer_head.classifier.weight, qa.answer_head.classifier.weight)

    back = LxmertForPreTraining.from_pretrained(qa_dir)
    _backbone_equal(back.lxmert, model.lxmert)
    nlvr2 = LxmertForNLVR2.from_pretrained(backbone.save_pretrained(tmp_path / "backbone"))
    _backbone_equal(nlvr2.lxmert, model.lxmert)
    with pytest.raises(TypeError, match="num_answers"):
        LxmertForQuestionAnswering.from_pretrained(directory)


def test_wrong_config_is_refused(pretrained_dir):
    _, directory = pretrained_dir
    with pytest.raises(ValueError, match="backbone"):
        Lxmert.from_pretrained(directory, l_layers=3)
    with pytest.raises(FileNotFoundError, match="config.json"):
        Lxmert.from_pretrained(directory / "nowhere")


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
    with caplog.at_level(logging.WARNING, logger="model.convert"):
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
        lx.close_where_real(ours(**inputs).lm_logits, hf(**inputs).prediction_logits, lx.real(inputs)[0])
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
