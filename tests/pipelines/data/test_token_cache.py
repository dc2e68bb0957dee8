"""A token cache file that cannot be what it claims (a FIFO, a device, a directory, too large for its
sentences, arrays that do not index each other or hold ids outside the vocabulary) is never read: one
warning line and the sentences are tokenised again; a directory in its place is one error line."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from pipelines.data.text import EncodedTexts, build_vocab, load_tokenizer
from pipelines.data.token_cache import cache_key

SENTS = ["what color is the dog", "how many cats", "is it blue"]
MAX_LENGTH = 8


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    corpus = root / "corpus.txt"
    corpus.write_text("what color is the dog\nhow many cats are on the red table\nis it blue\n")
    return load_tokenizer(build_vocab([corpus], root / "vocab.txt", 80))


def _reference(tokenizer) -> list[list[int]]:
    return [tokenizer(s, truncation=True, max_length=MAX_LENGTH)["input_ids"] for s in SENTS]


def _arrays(ids: list[int], offsets: list[int]) -> dict:
    return {"ids": np.array(ids, np.int32), "offsets": np.array(offsets, np.int64)}


@pytest.mark.parametrize(
    ("kind", "needle"),
    [
        ("fifo", "not a regular file"),
        ("device", "not a regular file"),
        ("huge", "more than 3 sentences of 8 tokens can take"),
        ("garbage", "unreadable"),
        ("wrong count", "for 2 sentences, not 3"),
        ("bad offsets", "offsets that do not index its ids"),
        ("too long", "offsets that do not index its ids in sentences of at most 8"),
        ("outside vocab", "ids outside the vocabulary"),
        ("pickled", "unreadable"),
    ],
)
def test_a_cache_that_cannot_be_read_is_tokenised_again(kind, needle, tokenizer, tmp_path, caplog):
    path = tmp_path / f"tokens-{cache_key(tokenizer, SENTS, MAX_LENGTH)[:32]}.npz"
    if kind == "fifo":
        os.mkfifo(path)  # reading it would wait forever
    elif kind == "device":
        path.symlink_to("/dev/zero")  # reading it would never end
    elif kind == "huge":
        with open(path, "wb") as fh:
            fh.truncate(1 << 30)  # sparse
    elif kind == "garbage":
        path.write_bytes(b"PK\x03\x04 not an archive")
    elif kind == "pickled":
        np.savez(path, ids=np.array([object()], dtype=object), offsets=np.array([0, 0, 0, 1]))
    else:
        arrays = {
            "wrong count": _arrays([5, 6], [0, 1, 2]),
            "bad offsets": _arrays([5, 6, 7], [0, 2, 1, 3]),
            "too long": _arrays([5] * 12, [0, 10, 11, 12]),
            "outside vocab": _arrays([5, 6, 10**6], [0, 1, 2, 3]),
        }[kind]
        with open(path, "wb") as fh:
            np.savez(fh, **arrays)
    with caplog.at_level(logging.WARNING, logger="pipelines.data.token_cache"):
        texts = EncodedTexts(tokenizer, SENTS, MAX_LENGTH, cache_dir=tmp_path)
    assert [texts[i].tolist() for i in range(len(SENTS))] == _reference(tokenizer)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and str(path) in warnings[0] and needle in warnings[0], warnings
    assert "\n" not in warnings[0]
    assert path.is_file() and not path.is_symlink(), "replaced by the fresh ids"
    again = EncodedTexts(tokenizer, SENTS, MAX_LENGTH, cache_dir=tmp_path)  # and read back from there
    assert [again[i].tolist() for i in range(len(SENTS))] == _reference(tokenizer)


def test_a_directory_in_the_cache_files_place_is_one_line(tokenizer, tmp_path):
    path = tmp_path / f"tokens-{cache_key(tokenizer, SENTS, MAX_LENGTH)[:32]}.npz"
    path.mkdir()
    with pytest.raises(ValueError) as info:
        EncodedTexts(tokenizer, SENTS, MAX_LENGTH, cache_dir=tmp_path)
    assert str(info.value) == (f"token cache {path} is a directory; remove it or choose another cache folder")
