"""WordPiece vocab building (`xmodal vocab build`) and loading it as a BERT uncased fast tokenizer."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from pipelines.cli import main as xmodal
from pipelines.data.text import SPECIAL_TOKENS, EncodedTexts, corpus_texts, load_tokenizer, save_tokenizer


def test_vocab_build_from_text_and_json_then_load(tmp_path):
    text = tmp_path / "captions.txt"
    text.write_text("A Red Circle next to a blue square\nthe GREEN star\n")
    pre = tmp_path / "pretrain.json"
    pre.write_text(
        json.dumps([{"img_id": "1", "sentf": {"vqa": ["what colour is the zebra?"]}, "labelf": {}}])
    )
    vqa = tmp_path / "vqa.json"
    vqa.write_text(json.dumps([{"question_id": 1, "img_id": "1", "sent": "how many giraffes?", "label": {}}]))
    assert len(list(corpus_texts([text, pre, vqa]))) == 4
    out = tmp_path / "v" / "vocab.txt"
    assert (
        xmodal(["vocab", "build", str(text), str(pre), str(vqa), "--out", str(out), "--vocab-size", "120"])
        == 0
    )
    lines = out.read_text().splitlines()
    assert tuple(lines[:5]) == SPECIAL_TOKENS and len(lines) <= 120 and len(set(lines)) == len(lines)
    tok = load_tokenizer(out)
    assert len(tok) == len(lines)
    enc = tok("A RED Zebra")["input_ids"]
    assert tok.convert_ids_to_tokens(enc) == ["[CLS]", "a", "red", "zebra", "[SEP]"]
    assert (tok.cls_token_id, tok.sep_token_id, tok.pad_token_id, tok.mask_token_id) == (2, 3, 0, 4)
    save_tokenizer(tok, tmp_path / "saved")
    assert load_tokenizer(tmp_path / "saved").get_vocab() == tok.get_vocab()
    other = tmp_path / "my_vocab.txt"
    other.write_text(out.read_text())
    assert load_tokenizer(other).get_vocab() == tok.get_vocab()


def test_bad_inputs(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"img_id": "1"}]')
    assert xmodal(["vocab", "build", str(bad), "--out", str(tmp_path / "v.txt")]) == 1
    assert "row 1: no text" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="xmodal vocab build"):
        load_tokenizer(tmp_path / "missing" / "vocab.txt")
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("hello\nworld\n")
    with pytest.raises(ValueError, match="special tokens"):
        load_tokenizer(vocab)


def test_a_vocab_of_special_tokens_alone_is_refused(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("".join(t + "\n" for t in SPECIAL_TOKENS))
    with pytest.raises(ValueError, match="0 tokens besides the special ones"):
        load_tokenizer(vocab)


def test_offline_hub_id_fails_fast_and_names_the_way_out(monkeypatch):
    """Offline, transformers returns a 5-token tokenizer after minutes of retries: refuse at once instead."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(OSError, match="--vocab") as err:
        load_tokenizer("no-such-org/no-such-vocab")
    assert "HF_HUB_OFFLINE" in str(err.value)
    assert time.monotonic() - start < 30


def test_unreachable_hub_fails_after_one_probe(monkeypatch):
    import huggingface_hub

    calls = []

    def unreachable(hub_id, timeout):
        calls.append((hub_id, timeout))
        raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "model_info", unreachable)
    with pytest.raises(OSError, match="Name or service not known.*xmodal vocab build"):
        load_tokenizer("bert-base-uncasd")
    assert len(calls) == 1 and calls[0][1] <= 10


class _Tok:
    """Whitespace tokenizer with BERT's [CLS]/[SEP] framing and truncation."""

    def __call__(self, sents, truncation, max_length):
        ids = [[101] + [len(w) for w in s.split()][: max_length - 2] + [102] for s in sents]
        return {"input_ids": ids}


def test_encoded_texts_round_trip_in_chunks():
    sents = ["a bb ccc", "dddd", "e f g h i j k"]
    texts = EncodedTexts(_Tok(), sents, max_length=5, chunk=2)
    assert [texts[i].tolist() for i in range(len(texts))] == [
        [101, 1, 2, 3, 102],
        [101, 4, 102],
        [101, 1, 1, 1, 102],
    ]
    assert texts[0].dtype == np.int64


@pytest.mark.parametrize(
    ("content", "named"),
    [
        (b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(range(256)), "a binary file, not text"),
        (b"what colour is the car?\n" * 3 + b"caf\xe9 au lait\n", "not UTF-8 text"),
    ],
    ids=["binary", "latin-1"],
)
def test_vocab_build_refuses_a_file_that_is_not_text_in_one_line(content, named, tmp_path, capsys):
    bad = tmp_path / "photo.txt"
    bad.write_bytes(content)
    good = tmp_path / "questions.txt"
    good.write_text("what colour is the car?\nhow many dogs are there?\n")
    assert xmodal(["vocab", "build", str(good), str(bad), "--out", str(tmp_path / "vocab.txt")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0] and named in err[0], err
    assert not (tmp_path / "vocab.txt").exists()


def test_vocab_build_reads_the_own_data_formats(tmp_path, capsys):
    """Issue 45: a questions CSV and {image, caption} JSON are rows, not plain text (no header or paths)."""
    questions = tmp_path / "questions.csv"
    questions.write_text("image,question,answer\n2023/IMG_001.jpg,what colour is the square?,red\n")
    captions = tmp_path / "captions.json"
    captions.write_text(json.dumps([{"image": "IMG_002.JPG", "caption": "a green triangle"}]))
    karpathy = tmp_path / "dataset_coco.json"
    karpathy.write_text(
        json.dumps({"images": [{"filename": "x.jpg", "split": "val", "sentences": [{"raw": "a blue star"}]}]})
    )
    texts = list(corpus_texts([questions, captions, karpathy]))
    assert texts == ["what colour is the square?", "a green triangle", "a blue star"]
    out = tmp_path / "vocab.txt"
    assert xmodal(["vocab", "build", str(questions), str(captions), "--out", str(out)]) == 0
    words = set(out.read_text().splitlines())
    assert {"square", "green", "triangle"} <= words and not {"image", "img", "jpg"} & words


def test_vocab_build_names_every_row_without_text(tmp_path, capsys):
    rows = tmp_path / "rows.csv"
    rows.write_text("image,answer\na.jpg,red\nb.jpg,blue\n")
    assert xmodal(["vocab", "build", str(rows), "--out", str(tmp_path / "vocab.txt")]) == 1
    err = capsys.readouterr().err.strip()
    assert "rows.csv: line 2: no text" in err and "line 3: no text" in err and len(err.splitlines()) == 1
