"""Text columns tokenised: a TEXT column's strings as token ids (`EncodedTexts`), written once beside the
columns and mapped after."""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from pipelines.data.columns import STEP, RowColumns, map_column, new_folder, publish, text_chunks
from pipelines.data.text import EncodedTexts
from pipelines.data.token_cache import cache_key

log = logging.getLogger(__name__)


def row_tokens(rows: RowColumns, name: str, tokenizer, max_length: int, cache_dir: str | Path | None):
    """`rows`' TEXT field `name` tokenised, indexed like the selected rows (`EncodedTexts`); cached beside the
    columns when they are mapped."""
    text, offsets = rows.columns[name], rows.columns[f"{name}_offsets"]
    count = len(offsets) - 1

    def chunks(size: int) -> Iterator[list[str]]:
        return text_chunks(text, offsets, size)

    if not rows.key:  # rows built from examples in memory: the token cache keyed by the sentences
        sents = [s for part in chunks(count or 1) for s in part]
        texts = EncodedTexts(tokenizer, sents, max_length, cache_dir=cache_dir)
        texts.rows = rows.rows
        return texts
    prefix = f"{rows.KIND}-{name}-tokens"
    return column_tokens(rows.key, prefix, count, chunks, rows.rows, tokenizer, max_length, cache_dir)


def column_tokens(
    source: str,
    prefix: str,
    count: int,
    chunks: Callable[[int], Iterator[list[str]]],
    rows: np.ndarray | None,
    tokenizer,
    max_length: int,
    cache_dir: str | Path | None,
    chunk: int = 65536,
):
    """The `count` strings `chunks(size)` gives tokenised (`EncodedTexts`, `rows`: its selection): read
    back from `cache_dir`'s `<prefix>-<key>` when it holds them for `source` (the columns' key), this
    vocabulary and length limit, else tokenised a chunk at a time and written there (a temporary folder,
    then renamed)."""

    vocab_size = len(tokenizer.get_vocab())
    key = cache_key(tokenizer, [source], max_length)[:32]
    final = None if cache_dir is None or not source else Path(cache_dir) / f"{prefix}-{key}"
    if final is not None and final.is_dir():
        try:
            meta = json.loads((final / "meta.json").read_text())
            total = int(meta["ids"])
            problem = _tokens_problem(final, total, count, max_length, vocab_size)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problem = f"unreadable ({exc})"
        if problem is None:
            ids = map_column(final / "ids.bin", np.int32, total)
            return EncodedTexts.of(ids, map_column(final / "offsets.bin", np.int64, count + 1), rows)
        log.warning("token cache %s is %s: tokenising again", final, problem)
        shutil.rmtree(final, ignore_errors=True)
    encode = _encoder(tokenizer, max_length)
    if final is not None:
        final.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_folder(final) if final is not None else Path(tempfile.mkdtemp(prefix="xmodal-tokens-"))
    try:
        total = 0
        with open(tmp / "ids.bin", "wb") as ids_fh, open(tmp / "offsets.bin", "wb") as off_fh:
            off_fh.write(np.zeros(1, np.int64).tobytes())
            for sents in chunks(chunk):
                pieces = encode(sents)
                lengths = np.fromiter(map(len, pieces), np.int64, len(pieces))
                flat = np.fromiter(itertools.chain.from_iterable(pieces), np.int32, int(lengths.sum()))
                ids_fh.write(flat.tobytes())
                off_fh.write((total + np.cumsum(lengths)).tobytes())
                total += int(lengths.sum())
        (tmp / "meta.json").write_text(json.dumps({"ids": total}))
        if final is None:
            ids = np.fromfile(tmp / "ids.bin", np.int32)
            offsets = np.fromfile(tmp / "offsets.bin", np.int64)
            return EncodedTexts.of(ids, offsets, rows)
        publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ids = map_column(final / "ids.bin", np.int32, total)
    return EncodedTexts.of(ids, map_column(final / "offsets.bin", np.int64, count + 1), rows)


def _encoder(tokenizer, max_length: int):
    """sentences -> `[CLS] ... [SEP]` id lists truncated to `max_length`, as `tokenizer(sents,
    truncation=True, max_length=max_length)` gives them: straight from a fast tokenizer's Rust backend
    (a copy, set to truncate) where there is one, skipping the per-sentence conversion transformers
    does, which costs as much as the tokenising itself."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "truncation_side", "right") != "right":

        def slow(sents: list[str]) -> list[list[int]]:
            return tokenizer(sents, truncation=True, max_length=max_length)["input_ids"]

        return slow
    from tokenizers import Tokenizer

    fast = Tokenizer.from_str(backend.to_str())
    fast.no_padding()
    fast.enable_truncation(max_length)

    def encode(sents: list[str]) -> list[list[int]]:
        return [e.ids for e in fast.encode_batch_fast(sents, add_special_tokens=True)]

    return encode


def _tokens_problem(folder: Path, total: int, pairs: int, max_length: int, vocab_size: int) -> str | None:
    """Why `folder`'s ids.bin / offsets.bin cannot be `pairs` sentences' token ids, or None (read in
    steps, not mapped)."""
    ids_path, offsets_path = folder / "ids.bin", folder / "offsets.bin"
    if os.stat(ids_path).st_size != 4 * total or os.stat(offsets_path).st_size != 8 * (pairs + 1):
        return f"not {total} ids in {pairs} sentences"
    previous = None
    for start in range(0, pairs + 1, STEP):
        offsets = np.fromfile(offsets_path, np.int64, min(STEP, pairs + 1 - start), offset=8 * start)
        if previous is None and offsets[0] != 0:
            return "holding offsets that do not start at 0"
        lengths = np.diff(offsets, prepend=offsets[0] if previous is None else previous)
        if (lengths < 0).any() or (lengths > max_length).any():
            return f"holding offsets that do not index its ids in sentences of at most {max_length}"
        previous = offsets[-1]
    if previous != total:
        return f"holding offsets that end at {previous}, not at its {total} ids"
    for start in range(0, total, STEP):
        ids = np.fromfile(ids_path, np.int32, min(STEP, total - start), offset=4 * start)
        if ids.min() < 0 or ids.max() >= vocab_size:
            return f"holding ids outside the vocabulary's 0..{vocab_size - 1}"
    return None
