"""Tokenised sentences cached on disk, keyed by the vocabulary, the length limit and the sentences."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import zipfile
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
    cached = _read(path, len(sents), max_length, len(tokenizer.get_vocab()))
    if cached is not None:
        return cached
    ids, offsets = tokenize()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        np.savez(fh, ids=ids, offsets=offsets)
    os.replace(tmp, path)
    return ids, offsets


def _read(path: Path, count: int, max_length: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The cached (ids, offsets) of `count` sentences, or None (with one warning line) when the file is
    missing, not a regular file of a size such a cache can have, or does not hold what it should; the
    caller then tokenises again and replaces it."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("token cache %s cannot be read (%s): tokenising again", path, exc.strerror)
        return None
    if stat.S_ISDIR(info.st_mode):
        raise ValueError(f"token cache {path} is a directory; remove it or choose another cache folder")
    # at most max_length int32 ids per sentence and an int64 offset each, plus the archive's headers
    limit = 4 * count * max_length + 8 * (count + 1) + 4096
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = "not a regular file (a FIFO, socket or device)"
    elif info.st_size > limit:
        problem = f"{info.st_size} bytes, more than {count} sentences of {max_length} tokens can take"
    else:
        try:
            with np.load(path, allow_pickle=False) as saved:
                ids, offsets = saved["ids"], saved["offsets"]
            problem = _content_problem(ids, offsets, count, max_length, vocab_size)
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
            problem = f"unreadable ({exc})"
    if problem is None:
        return ids, offsets
    log.warning("token cache %s is %s: tokenising again", path, problem)
    return None


def _content_problem(
    ids: np.ndarray, offsets: np.ndarray, count: int, max_length: int, vocab_size: int
) -> str | None:
    """Why cached arrays cannot be `count` sentences' token ids, or None."""
    if ids.ndim != 1 or offsets.ndim != 1 or ids.dtype.kind not in "iu" or offsets.dtype.kind not in "iu":
        return f"not token arrays (ids {ids.dtype}{ids.shape}, offsets {offsets.dtype}{offsets.shape})"
    if len(offsets) != count + 1:
        return f"for {len(offsets) - 1} sentences, not {count}"
    lengths = np.diff(offsets)
    if offsets[0] != 0 or offsets[-1] != len(ids) or (lengths < 0).any() or (lengths > max_length).any():
        return f"holding offsets that do not index its ids in sentences of at most {max_length}"
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        return f"holding ids outside the vocabulary's 0..{vocab_size - 1}"
    return None
