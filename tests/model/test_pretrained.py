"""save_pretrained / from_pretrained across the classes of a family; old and foreign directories."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from model import (
    Lxmert,
    LxmertForNLVR2,
    LxmertForPreTraining,
    LxmertForQuestionAnswering,
    read_checkpoint,
    read_config,
)

REPO = Path(__file__).resolve().parents[2]


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

    with caplog.at_level(logging.WARNING, logger="model.pretrained"):
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


def test_directory_records_format_family_and_class(pretrained_dir):
    model, directory = pretrained_dir
    meta = json.loads((directory / "config.json").read_text())
    assert (meta["format"], meta["family"], meta["architecture"]) == (
        "xmodal",
        "lxmert",
        "LxmertForPreTraining",
    )
    architecture, config, kwargs = read_config(directory)
    assert (architecture, config, kwargs) == ("LxmertForPreTraining", model.config.to_dict(), {})


def test_directories_of_the_single_family_format_still_load(pretrained_dir, tmp_path):
    """Directories written before families shared the loader say "xmodal-lxmert" and name no family."""
    model, directory = pretrained_dir
    old = tmp_path / "old"
    old.mkdir()
    meta = json.loads((directory / "config.json").read_text())
    del meta["family"]
    meta["format"] = "xmodal-lxmert"
    (old / "config.json").write_text(json.dumps(meta))
    (old / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes())
    _backbone_equal(Lxmert.from_pretrained(old), model.lxmert)
    assert read_checkpoint(old)[0] == "LxmertForPreTraining"


def test_huggingface_directory_is_read_through_its_family(lx, cfg, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    hf = transformers.LxmertForQuestionAnswering(lx.hf_config(cfg)).eval()
    hf.save_pretrained(tmp_path / "hf")
    architecture, _, kwargs, state = read_checkpoint(tmp_path / "hf")
    assert architecture == "LxmertForQuestionAnswering" and kwargs == {"num_answers": cfg.num_qa_labels}
    qa = LxmertForQuestionAnswering.from_pretrained(tmp_path / "hf").eval()
    assert set(state) == set(qa.state_dict())
    inputs = lx.make_inputs(cfg)
    with torch.no_grad():
        torch.testing.assert_close(
            qa(**inputs).logits, hf(**inputs).question_answering_score, atol=1e-5, rtol=1e-5
        )


def test_unknown_directories_are_named(pretrained_dir, tmp_path):
    _, directory = pretrained_dir
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "bert"}')
    unknown = r"other/config.json is neither an xmodal config.*\(lxmert(, \w+)*\)"
    with pytest.raises(ValueError, match=unknown):
        read_checkpoint(other)
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    meta = json.loads((directory / "config.json").read_text())
    (renamed / "config.json").write_text(json.dumps({**meta, "architecture": "LxmertForCaptions"}))
    (renamed / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"renamed/config.json: unknown architecture 'LxmertForCaptions'"):
        Lxmert.from_pretrained(renamed)
    (renamed / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot be read as a safetensors file"):
        read_checkpoint(renamed)


def test_a_config_far_larger_than_its_weights_is_refused_before_building(pretrained_dir, tmp_path):
    """Each size in range, together 8192 wide x 12 layers (GBs): one ValueError naming the directory, with
    peak memory that of the small model (the child is capped at 6 GiB of address space, a regression dies)."""
    _, directory = pretrained_dir
    huge = tmp_path / "huge"
    huge.mkdir()
    meta = json.loads((directory / "config.json").read_text())
    meta["config"].update(hidden_size=8192, num_attention_heads=64, l_layers=12, r_layers=12, x_layers=12)
    (huge / "config.json").write_text(json.dumps(meta))
    (huge / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes())
    script = f"""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
        from model import LxmertForQuestionAnswering
        try:
            LxmertForQuestionAnswering.from_pretrained({str(huge)!r}, num_answers=5)
        except ValueError as exc:
            print(exc)
        print(int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) >> 10)
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    error, peak_mb = proc.stdout.splitlines()
    assert f"{huge}: backbone" in error and "more" in error and len(error) < 1000, error
    assert int(peak_mb) < 1500, peak_mb
