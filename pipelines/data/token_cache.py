"""Tokenised sentences cached on disk, keyed by the vocabulary, the length limit and the sentences."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

CACHE_VERSION = 1  # bump when the cached arrays change meaning


def cache_key(tokenizer, sents: Sequence[str], max_length: int) -> str:
    """sha256 of what the token ids depend on: the vocabulary (tokens and ids), lowercasing, the
    length limit and every sentence, in order. A changed vocab or data file gives another key."""
    h = hashlib.sha256()
    vocab = tokenizer.get_vocab()
    lower = bool(getattr(tokenizer, "do_lower_case", True))
    h.update(json.dumps([CACHE_VERSION, max_length, lower, sorted(vocab.items())]).encode())
    for s in sents:
        h.update(s.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


def load_or_tokenize(
    tokenize, tokenizer, sents: Sequence[str], max_length: int, cache_dir: str | Path | None
):
    """(flat ids int32, offsets int64): read from `cache_dir` when it holds this key, else `tokenize()`
    and write them there (atomically: a crash leaves no half file). No `cache_dir`: just tokenise."""
    if cache_dir is None:
        return tokenize()
    path = Path(cache_dir) / f"tokens-{cache_key(tokenizer, sents, max_length)[:32]}.npz"
    if path.is_file():
        try:
            with np.load(path) as saved:
                ids, offsets = saved["ids"], saved["offsets"]
            if len(offsets) == len(sents) + 1:
                return ids, offsets
        except (OSError, ValueError, KeyError) as exc:
            log.warning("token cache %s is unreadable (%s): tokenising again", path, exc)
    ids, offsets = tokenize()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        np.savez(fh, ids=ids, offsets=offsets)
    os.replace(tmp, path)
    return ids, offsets
