"""`xmodal convert vlbert|visualbert`: release files and transformers directories to xmodal directories."""

from __future__ import annotations

import pytest
import torch

from model.visualbert import VisualBertConfig, VisualBertForPreTraining
from model.vlbert import VlBertConfig, VlBertForQuestionAnswering
from pipelines.cli import main

TINY_VL = {"vocab_size": 50, "hidden_size": 64, "num_hidden_layers": 1, "geometry_dim": 8}


def _release_name(ours: str) -> str:
    """xmodal's VL-BERT QA name -> the release's (its Fast R-CNN module holds the visual embedding)."""
    for mine, theirs in (
        ("vlbert.obj_downsample.", "image_feature_extractor.obj_downsample."),
        ("vlbert.object_linguistic_embeddings.", "object_linguistic_embeddings."),
    ):
        if ours.startswith(mine):
            return "module." + theirs + ours[len(mine) :]
    return "module." + ours


def test_convert_vlbert_release_file(tmp_path, capsys):
    torch.manual_seed(0)
    model = VlBertForQuestionAnswering(VlBertConfig.preset("tiny", **TINY_VL), num_answers=3)
    state = {_release_name(k): v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "epoch": 19}, tmp_path / "vl-bert_vqa.model")
    argv = ["convert", "vlbert", str(tmp_path / "vl-bert_vqa.model"), str(tmp_path / "out")]
    assert main([*argv, "--num-attention-heads", "2"]) == 0
    assert "converted" in capsys.readouterr().out
    loaded = VlBertForQuestionAnswering.from_pretrained(tmp_path / "out")
    assert loaded.config == model.config
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_convert_visualbert_transformers_directory(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    hf = transformers.VisualBertForPreTraining(
        transformers.VisualBertConfig(
            vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=40,
            visual_embedding_dim=16, architectures=["VisualBertForPreTraining"],
        )
    )  # fmt: skip
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", "visualbert", str(tmp_path / "hf"), str(tmp_path / "out")]) == 0
    loaded = VisualBertForPreTraining.from_pretrained(tmp_path / "out")
    assert loaded.config.visual_feat_dim == 16 and isinstance(loaded.config, VisualBertConfig)
    # uclanlp/visualbert's hub weights score "matched" at row 1, as xmodal does: nothing moves either way
    assert torch.equal(loaded.cls.seq_relationship.weight, hf.cls.seq_relationship.weight)
    assert main(["convert", "visualbert", "--to-hf", str(tmp_path / "out"), str(tmp_path / "back")]) == 1
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "dog"]
    (tmp_path / "out" / "vocab.txt").write_text("\n".join(words))
    assert main(["convert", "visualbert", "--to-hf", str(tmp_path / "out"), str(tmp_path / "back")]) == 0
    back = type(hf).from_pretrained(tmp_path / "back")
    for name, value in hf.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name


def test_errors_are_one_line_naming_the_file(tmp_path, capsys):
    missing = tmp_path / "nope.model"
    assert main(["convert", "vlbert", str(missing), str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(missing) in err and "does not exist" in err
    other = tmp_path / "resnet.pth"
    torch.save({"conv1.weight": torch.zeros(2, 3)}, other)
    assert main(["convert", "vlbert", str(other), str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a VL-BERT checkpoint" in err
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"model_type": "bert"}')
    assert main(["convert", "visualbert", str(tmp_path / "bert"), str(tmp_path / "c")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a transformers VisualBERT" in err
