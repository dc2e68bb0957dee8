"""`xmodal convert visualbert`: a fine-tuned xmodal directory out to transformers' layout and back."""

from __future__ import annotations

import json

import pytest
import torch

from model.visualbert import VisualBertConfig, VisualBertForQuestionAnswering
from pipelines.cli import main
from pipelines.data.answers import AnswerTable

transformers = pytest.importorskip("transformers")

WORDS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "what", "color", "is", "the", "ball", "red", "blue")
ANSWERS = ["red", "blue", "green"]


@pytest.fixture
def tuned(tmp_path):
    """A directory as `finetune` writes it: the model, its answer table and its vocabulary."""
    cfg = VisualBertConfig.preset("tiny", vocab_size=len(WORDS), visual_feat_dim=16)
    torch.manual_seed(0)
    directory = tmp_path / "best"
    VisualBertForQuestionAnswering(cfg, num_answers=len(ANSWERS)).save_pretrained(directory)
    AnswerTable(ANSWERS).save(directory / "ans2label.json")
    (directory / "vocab.txt").write_text("".join(w + "\n" for w in WORDS))
    return directory


def test_to_hf_writes_a_directory_transformers_uses_as_it_is(tuned, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["convert", "visualbert", str(tuned), str(out), "--to-hf"]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("what color is the ball")["input_ids"] == [2, 5, 6, 7, 8, 9, 3]
    hf = transformers.VisualBertForQuestionAnswering.from_pretrained(out)
    assert hf.config.id2label == dict(enumerate(ANSWERS)) and hf.config.visual_embedding_dim == 16
    ours = VisualBertForQuestionAnswering.from_pretrained(tuned)
    torch.testing.assert_close(hf.cls.weight, ours.cls.weight, rtol=0, atol=0)
    # and back: transformers' directory converts to xmodal's with the vocabulary beside it
    assert main(["convert", "visualbert", str(out), str(tmp_path / "back")]) == 0
    back = VisualBertForQuestionAnswering.from_pretrained(tmp_path / "back")
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], value, rtol=0, atol=0)
    assert (tmp_path / "back" / "vocab.txt").read_text() == (tuned / "vocab.txt").read_text()


def test_a_table_that_does_not_fit_the_head_is_refused_before_anything_is_written(tuned, tmp_path, capsys):
    table = tmp_path / "answers.json"
    table.write_text(json.dumps(["yes", "no"]))
    out = tmp_path / "hf"
    argv = ["convert", "visualbert", str(tuned), str(out), "--to-hf", "--answers", str(table)]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "its QA head has 3 answers, but the answer table 2" in err, err
    assert not out.exists()
    assert main(["convert", "visualbert", str(tuned), str(out), "--answers", str(table)]) == 1
    assert "--answers only applies with --to-hf" in capsys.readouterr().err
