"""Caption data: Karpathy split JSON, COCO caption annotations, the vocabulary, and clear errors."""

from __future__ import annotations

import json

import pytest

from pipelines.data.captions import (
    CaptionDataError,
    Vocabulary,
    read_coco_captions,
    read_karpathy_split,
    tokenize_caption,
)


def karpathy_row(cocoid: int, split: str, sentences: list[str]) -> dict:
    return {
        "filepath": "val2014" if split != "train" else "train2014",
        "filename": f"COCO_{cocoid:012d}.jpg",
        "imgid": cocoid + 1000,
        "split": split,
        "sentids": list(range(len(sentences))),
        "sentences": [
            {"tokens": tokenize_caption(s), "raw": s, "imgid": cocoid + 1000, "sentid": i}
            for i, s in enumerate(sentences)
        ],
        "cocoid": cocoid,
    }


def test_karpathy_split(tmp_path):
    path = tmp_path / "dataset_coco.json"
    rows = [
        karpathy_row(1, "train", ["A dog runs.", "A dog running"]),
        karpathy_row(2, "restval", ["Two cats."]),
        karpathy_row(3, "val", ["A man."]),
        karpathy_row(4, "test", ["A woman."]),
    ]
    path.write_text(json.dumps({"images": rows, "dataset": "coco"}))
    images = read_karpathy_split(path)
    assert [im.split for im in images] == ["train", "train", "val", "test"]
    assert images[0].captions == [["a", "dog", "runs"], ["a", "dog", "running"]]
    assert images[0].raw[0] == "A dog runs."
    assert (images[0].image_id, images[0].filename, images[0].filepath) == (
        1,
        "COCO_000000000001.jpg",
        "train2014",
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"annotations": []}), "'images' list"),
        (
            json.dumps({"images": [{"cocoid": 1, "split": "train", "sentences": []}]}),
            r"images\[0\] lacks",
        ),
        (json.dumps({"images": [karpathy_row(1, "holdout", ["a"])]}), "split 'holdout'"),
        (
            json.dumps({"images": [{**karpathy_row(1, "train", ["a"]), "sentences": [{"tokens": "a b"}]}]}),
            "tokens",
        ),
    ],
)
def test_karpathy_errors_name_file_and_record(tmp_path, content, message):
    path = tmp_path / "dataset_coco.json"
    path.write_text(content)
    with pytest.raises(CaptionDataError, match=message) as err:
        read_karpathy_split(path)
    assert str(path) in str(err.value)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(CaptionDataError, match="no such file"):
        read_karpathy_split(tmp_path / "absent.json")


def test_coco_caption_annotations(tmp_path):
    path = tmp_path / "captions_train2014.json"
    data = {
        "images": [
            {"id": 9, "file_name": "COCO_train2014_000000000009.jpg"},
            {"id": 25, "file_name": "b.jpg"},
        ],
        "annotations": [
            {"image_id": 9, "id": 1, "caption": "A plate of food. "},
            {"image_id": 25, "id": 2, "caption": "A giraffe eating."},
            {"image_id": 9, "id": 3, "caption": "Food on a plate"},
        ],
    }
    path.write_text(json.dumps(data))
    images = {im.image_id: im for im in read_coco_captions(path)}
    assert images[9].raw == ["A plate of food.", "Food on a plate"]
    assert images[9].captions[0] == ["a", "plate", "of", "food"]
    assert images[25].filename == "b.jpg" and images[25].split == "train"
    data["annotations"].append({"image_id": 7, "caption": "x"})
    path.write_text(json.dumps(data))
    with pytest.raises(CaptionDataError, match=r"image id\(s\) \[7\]"):
        read_coco_captions(path)
    data["annotations"] = [{"image_id": 9}]
    path.write_text(json.dumps(data))
    with pytest.raises(CaptionDataError, match=r"annotations\[0\]"):
        read_coco_captions(path)


def test_vocabulary_threshold_specials_and_round_trip(tmp_path):
    captions = [["a", "dog"]] * 5 + [["a", "cat"]] * 4 + [["the", "dog", "runs"]] * 5
    vocab = Vocabulary.build(captions, count_threshold=5)
    assert vocab.words[:4] == ["<pad>", "<bos>", "<eos>", "<unk>"]
    assert set(vocab.words[4:]) == {"a", "dog", "the", "runs"}  # 'cat' seen 4 times: below the threshold
    assert vocab.words[4:6] == ["dog", "a"]  # most frequent first (10 and 9 times)
    ids = vocab.encode(["a", "cat", "runs"])
    assert ids[0] == vocab.bos_id and ids[-1] == vocab.eos_id and ids[2] == vocab.unk_id
    assert vocab.decode(ids + [0, 0]) == "a <unk> runs"
    assert len(vocab.encode(["a"] * 30)) == 16 + 2  # at most 16 words, as the references
    vocab.save(tmp_path / "vocab.json")
    assert Vocabulary.load(tmp_path / "vocab.json").words == vocab.words
    (tmp_path / "bad.json").write_text(json.dumps({"words": ["a"]}))
    with pytest.raises(CaptionDataError, match="not a caption vocabulary"):
        Vocabulary.load(tmp_path / "bad.json")


def test_a_vocab_txt_is_a_caption_vocabulary(tmp_path):
    """Issue 45: `--vocab vocab.txt` means the same for a captioner: its whole words (no [PAD] or ##)."""
    path = tmp_path / "vocab.txt"
    path.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n?\na\n##s\nsquare\nred\nred\n")
    vocab = Vocabulary.load(path)
    assert vocab.words == ["<pad>", "<bos>", "<eos>", "<unk>", "?", "a", "square", "red"]
    assert Vocabulary.load(tmp_path).words == vocab.words  # a directory holding one


def test_a_file_the_user_wrote_is_not_to_be_re_downloaded(tmp_path):
    path = tmp_path / "vocab.json"
    path.write_text("not json")
    with pytest.raises(CaptionDataError) as err:
        Vocabulary.load(path)
    assert "vocab.json" in str(err.value) and "re-download" not in str(err.value)
