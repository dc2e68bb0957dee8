"""`xmodal convert vilbert`: a fake vilbert-multi-task file becomes a directory every ViLBERT class loads."""

from __future__ import annotations

import json

import torch

from model.vilbert import VilbertConfig, VilbertForPreTraining, VilbertForQuestionAnswering
from pipelines.cli import main

SMALL = {"vocab_size": 50, "visual_feat_dim": 12}


def _release_file(path, with_vqa_head: bool) -> dict[str, torch.Tensor]:
    """A file in the release's names: the pre-training model's state plus the keys ours leaves out."""
    cfg = VilbertConfig.preset("tiny", **SMALL)
    state = dict(VilbertForPreTraining(cfg).state_dict())
    state["cls.predictions.decoder.weight"] = state["bert.embeddings.word_embeddings.weight"]
    for k in range(cfg.num_co_layers):
        for side, width in (("1", cfg.v_hidden_size), ("2", cfg.hidden_size)):
            state[f"bert.encoder.c_layer.{k}.biOutput.q_dense{side}.weight"] = torch.zeros(
                width, cfg.bi_hidden_size
            )
            state[f"bert.encoder.c_layer.{k}.biOutput.q_dense{side}.bias"] = torch.zeros(width)
    if with_vqa_head:
        b = cfg.bi_hidden_size
        head = VilbertForQuestionAnswering(cfg, num_answers=5).vil_prediction.state_dict()
        state |= {f"vil_prediction.{k}": v for k, v in head.items()}
        assert state["vil_prediction.logit_fc.0.weight"].shape == (2 * b, b)
    torch.save({f"module.{k}": v for k, v in state.items()}, path)
    return state


def _config(tmp_path) -> str:
    path = tmp_path / "bert_tiny.json"
    cfg = VilbertConfig.preset("tiny", **SMALL)
    path.write_text(json.dumps({"v_feature_size": cfg.visual_feat_dim, "vocab_size": cfg.vocab_size}))
    return str(path)


def test_convert_vilbert_writes_a_loadable_directory(tmp_path, capsys):
    state = _release_file(tmp_path / "multi_task_model.bin", with_vqa_head=True)
    argv = ["convert", "vilbert", str(tmp_path / "multi_task_model.bin"), str(tmp_path / "out")]
    assert main([*argv, "--preset", "tiny", "--config", _config(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "converted" in out and "VilbertForQuestionAnswering" in out
    model = VilbertForQuestionAnswering.from_pretrained(tmp_path / "out")
    assert model.num_answers == 5
    assert torch.equal(
        model.state_dict()["vil_prediction.logit_fc.3.weight"], state["vil_prediction.logit_fc.3.weight"]
    )
    assert json.loads((tmp_path / "out" / "config.json").read_text())["family"] == "vilbert"
    assert (
        main(
            [
                *argv[:3],
                str(tmp_path / "pre"),
                "--preset",
                "tiny",
                "--config",
                _config(tmp_path),
                "--head",
                "pretraining",
            ]
        )
        == 0
    )
    VilbertForPreTraining.from_pretrained(tmp_path / "pre")


def test_convert_vilbert_errors_are_one_line_naming_the_file(tmp_path, capsys):
    _release_file(tmp_path / "pretrained_model.bin", with_vqa_head=False)
    # The base preset does not fit the tiny file: every mis-shaped name is counted, nothing is written.
    assert main(["convert", "vilbert", str(tmp_path / "pretrained_model.bin"), str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(tmp_path / "pretrained_model.bin") in err and "of another shape" in err
    assert not (tmp_path / "a").exists()
    (tmp_path / "corrupt.bin").write_bytes(b"not a checkpoint")
    assert main(["convert", "vilbert", str(tmp_path / "corrupt.bin"), str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "cannot be read" in err and "corrupt.bin" in err
    bad_head = ["--preset", "tiny", "--config", _config(tmp_path), "--head", "vcr"]
    assert (
        main(["convert", "vilbert", str(tmp_path / "pretrained_model.bin"), str(tmp_path / "c"), *bad_head])
        == 1
    )
    assert "choose one of" in capsys.readouterr().err
