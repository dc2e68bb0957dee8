"""The pre-training corpus as memory-mapped columns: the community JSON converted once (streamed, in bounded
memory) into flat numpy arrays on disk that loader workers share without copying."""

from __future__ import annotations

import codecs
import hashlib
import itertools
import json
import logging
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model.files import regular_file

log = logging.getLogger(__name__)

CORPUS_VERSION = 1  # bump when the converted columns change meaning
READ_CHUNK = 8 << 20  # characters of JSON decoded per read
FLUSH_PAIRS = 1 << 16  # pairs gathered in lists before they are appended to the column files

# column -> dtype; "text", "answers" and "images" columns are flat with an int64 `*_offsets` column
COLUMNS = {
    "image": np.int32,  # index into the image table
    "source": np.int32,  # index into the source table
    "sentence_hash": np.int64,  # a stable 64-bit hash of the sentence (blake2b)
    "question": np.bool_,  # labelf gives this sentence an {answer: score} object (maybe empty)
    "text": np.uint8,  # UTF-8 sentences, back to back
    "text_offsets": np.int64,
    "answer_ids": np.int32,  # index into the answer-string table, each pair's answers in file order
    "answer_scores": np.float64,
    "answer_offsets": np.int64,
}


PAIRS_STEP = 1 << 20  # pairs whose answers are sorted together


class Mapped(np.memmap):
    """A read-only column mapped from its file; pickled as its file name (a Ray worker maps it again)
    rather than as its bytes."""

    def __array_finalize__(self, obj) -> None:
        super().__array_finalize__(obj)
        self._whole = False  # a slice or a result computed from the column pickles as data

    def __getitem__(self, index):
        res = super().__getitem__(index)
        if isinstance(res, np.memmap) and res._mmap is None:  # a copy (fancy indexing): a plain array
            return res.view(np.ndarray)
        return res

    def __reduce__(self):
        if getattr(self, "_whole", False):
            return map_column, (self.filename, self.dtype.str, len(self))
        return np.asarray(self).copy().__reduce__()


def map_column(path: str | Path, dtype, count: int) -> np.ndarray:
    """`count` items of `dtype` in file `path`, mapped read-only (an empty column is a plain array)."""
    if count == 0:
        return np.zeros(0, dtype)
    arr = Mapped(path, dtype=dtype, mode="r", shape=(count,))
    arr._whole = True
    return arr


def sentence_hashes(sents: Iterable[bytes]) -> np.ndarray:
    """int64 hash of each UTF-8 sentence, the same in every process and run (Python's `hash` is salted)."""
    digest = b"".join(hashlib.blake2b(s, digest_size=8).digest() for s in sents)
    return np.frombuffer(digest, dtype="<i8").astype(np.int64)


def source_key(paths: Sequence[str | Path]) -> str:
    """sha256 of what the columns depend on: each file's resolved path, size, mtime and inode, in order."""
    ident = []
    for p in paths:
        info = os.stat(p)
        ident.append([str(Path(p).resolve()), info.st_size, info.st_mtime_ns, info.st_ino])
    return hashlib.sha256(json.dumps([CORPUS_VERSION, ident]).encode()).hexdigest()


class _Writer:
    """Columns appended to files in `directory`, and the image, source and answer tables."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.files = {name: open(directory / f"{name}.bin", "wb") for name in COLUMNS}  # noqa: SIM115
        self.counts = dict.fromkeys(COLUMNS, 0)
        self.images: dict[str, int] = {}
        self.sources: dict[str, int] = {}
        self.answers: dict[str, int] = {}
        self.text_end = self.answer_end = 0
        self._put("text_offsets", np.zeros(1, np.int64))
        self._put("answer_offsets", np.zeros(1, np.int64))
        self._clear()

    def _clear(self) -> None:
        self.pair_image: list[int] = []
        self.pair_source: list[int] = []
        self.sents: list[str] = []
        self.question: list[bool] = []
        self.answer_counts: list[int] = []
        self.answer_ids: list[int] = []
        self.answer_scores: list[float] = []

    def _put(self, name: str, values: np.ndarray) -> None:
        values = np.ascontiguousarray(values, dtype=COLUMNS[name])
        self.files[name].write(values.tobytes())
        self.counts[name] += len(values)

    def add(self, img_id: str, source: str, sents: list[str], labels: list[dict] | None) -> None:
        """One row's sentences of one source (`labels` aligned with them, or None: not questions)."""
        if not sents:  # an image without sentences is not one the corpus uses
            return
        image = self.images.setdefault(img_id, len(self.images))
        code = self.sources.setdefault(source, len(self.sources))
        n = len(sents)
        self.pair_image += [image] * n
        self.pair_source += [code] * n
        self.sents += sents
        self.question += [labels is not None] * n
        if labels is None:
            self.answer_counts += [0] * n
        else:
            for label in labels:
                self.answer_counts.append(len(label))
                for ans, score in label.items():
                    self.answer_ids.append(self.answers.setdefault(ans, len(self.answers)))
                    self.answer_scores.append(float(score))
        if len(self.sents) >= FLUSH_PAIRS:
            self.flush()

    def flush(self) -> None:
        if not self.sents:
            return
        encoded = [s.encode("utf-8") for s in self.sents]
        lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
        self._put("image", np.array(self.pair_image))
        self._put("source", np.array(self.pair_source))
        self._put("sentence_hash", sentence_hashes(encoded))
        self._put("question", np.array(self.question))
        self.files["text"].write(b"".join(encoded))
        self.counts["text"] += int(lengths.sum())
        self._put("text_offsets", self.text_end + np.cumsum(lengths))
        self.text_end += int(lengths.sum())
        self._put("answer_ids", np.array(self.answer_ids, np.int32))
        self._put("answer_scores", np.array(self.answer_scores, np.float64))
        self._put("answer_offsets", self.answer_end + np.cumsum(np.array(self.answer_counts, np.int64)))
        self.answer_end += len(self.answer_ids)
        self._clear()

    def close(self, key: str) -> None:
        self.flush()
        for fh in self.files.values():
            fh.close()
        meta = {
            "version": CORPUS_VERSION,
            "key": key,
            "counts": self.counts,
            "images": list(self.images),
            "sources": list(self.sources),
            "answers": list(self.answers),
        }
        (self.directory / "meta.json").write_text(json.dumps(meta, ensure_ascii=False))


def _json_rows(path: Path) -> Iterator[object]:
    """The elements of the JSON list in `path`, decoded a chunk at a time; ValueError naming the file for
    a file that is not a JSON list."""
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    buf, pos, lines_before, eof = "", 0, 0, False
    with open(path, "rb") as fh:

        def more() -> bool:
            nonlocal buf, pos, lines_before, eof
            if eof:
                return False
            raw = fh.read(READ_CHUNK)
            try:
                text = utf8.decode(raw, final=not raw)
            except UnicodeDecodeError as exc:
                raise ValueError(f"JSON file {str(path)!r} is not UTF-8 text ({exc.reason})") from None
            lines_before += buf.count("\n", 0, pos)
            buf, pos, eof = buf[pos:] + text, 0, not raw
            return True

        def skip_space() -> bool:
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n":
                    pos += 1
                if pos < len(buf) or not more():
                    return pos < len(buf)

        def invalid(msg: str, at: int):
            line = lines_before + buf.count("\n", 0, at) + 1
            col = at - buf.rfind("\n", 0, at)
            return ValueError(f"{path}: not valid JSON ({msg} at line {line}, column {col}); fix the file")

        if not skip_space() or buf[pos] != "[":
            if skip_space() and buf[pos] in '{"0123456789-tfn':
                raise ValueError(f"{path}: expected a JSON list of {{img_id, sentf, labelf}} rows")
            raise invalid("Expecting value", pos)
        pos += 1
        first = True
        while True:
            if not skip_space():
                raise invalid("Expecting ']'", pos)
            if buf[pos] == "]":
                pos += 1
                if skip_space():
                    raise invalid("Extra data", pos)
                return
            if not first:
                if buf[pos] != ",":
                    raise invalid("Expecting ',' delimiter", pos)
                pos += 1
                if not skip_space():
                    raise invalid("Expecting value", pos)
            first = False
            while True:
                try:
                    value, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError as exc:
                    if more():  # the element may run past what is read so far
                        continue
                    raise invalid(exc.msg, exc.pos) from None
                except RecursionError:
                    raise ValueError(f"{path}: JSON nested too deeply to read; fix the file") from None
                if end == len(buf) and more():  # a number may go on in the next chunk
                    continue
                break
            pos = end
            yield value


def _add_row(writer: _Writer, row: object, where: str) -> None:
    """A community-format row's pairs, checked as `read_pretrain_json` checks them."""
    if not isinstance(row, dict):
        raise ValueError(
            f"{where}: expected an object with img_id, sentf and labelf, got {type(row).__name__}"
        )
    img_id = row.get("img_id")
    if not isinstance(img_id, str) or not img_id:
        raise ValueError(f"{where}: 'img_id' must be a non-empty string, got {img_id!r}")
    where = f"{where} (img_id {img_id!r})"
    sentf = row.get("sentf")
    if not isinstance(sentf, dict):
        raise ValueError(f"{where}: 'sentf' must map a source to a list of sentences")
    labelf = row.get("labelf") or {}
    if not isinstance(labelf, dict):
        raise ValueError(f"{where}: 'labelf' must map a source to a list of {{answer: score}}")
    for source, sents in sentf.items():
        if not isinstance(sents, list) or not all(isinstance(s, str) for s in sents):
            raise ValueError(f"{where}: sentf[{source!r}] must be a list of strings")
        labels = labelf.get(source)
        if labels is not None:
            if not isinstance(labels, list) or len(labels) != len(sents):
                raise ValueError(
                    f"{where}: labelf[{source!r}] must be a list aligned with sentf[{source!r}] "
                    f"({len(sents)} sentences)"
                )
            for k, label in enumerate(labels):
                if not isinstance(label, dict) or not all(
                    isinstance(a, str) and isinstance(s, (int, float)) for a, s in label.items()
                ):
                    raise ValueError(f"{where}: labelf[{source!r}][{k}] must be an {{answer: score}} object")
        writer.add(img_id, source, sents, labels)


def convert(paths: Sequence[str | Path], directory: Path, key: str) -> None:
    """Stream the community JSON files `paths` into columns in `directory` (which must exist)."""
    writer = _Writer(directory)
    try:
        for path in paths:
            path = Path(path)
            try:
                regular_file(path, "JSON file")
            except FileNotFoundError as exc:
                raise ValueError(str(exc)) from None
            for i, row in enumerate(_json_rows(path)):
                _add_row(writer, row, f"{path}: row {i}")
    finally:
        writer.close(key)


@dataclass(slots=True)
class PretrainExample:
    """One (image, sentence) pair; `label` is the sentence's {answer: score} when it is a question."""

    img_id: str
    sentence: str
    source: str
    label: dict[str, float] | None = None


class PretrainCorpus(Sequence):
    """(image, sentence) pairs as columns (see COLUMNS) over one image table; `rows` selects and orders
    pairs of the columns (None: all, as converted). Item i is the `PretrainExample` of pair i, built on
    demand."""

    def __init__(self, columns: dict[str, np.ndarray], meta: dict, rows: np.ndarray | None = None):
        self.columns, self.meta, self.rows = columns, meta, rows
        self.images: list[str] = meta["images"]
        self.sources: list[str] = meta["sources"]
        self.answer_names: list[str] = meta["answers"]
        self.key: str = meta["key"]

    # ---- opening
    @classmethod
    def open(cls, directory: str | Path) -> PretrainCorpus:
        """The converted columns in `directory`, mapped; ValueError when they are not whole."""
        directory = Path(directory)
        meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
        if meta.get("version") != CORPUS_VERSION:
            raise ValueError(f"{directory}: converted by another version")
        columns = {}
        for name, dtype in COLUMNS.items():
            path = directory / f"{name}.bin"
            count = int(meta["counts"][name])
            size = os.stat(path).st_size
            if size != count * np.dtype(dtype).itemsize:
                raise ValueError(f"{path}: {size} bytes, not the {count} items recorded")
            columns[name] = map_column(path, dtype, count)
        pairs = len(columns["image"])
        for name in ("text_offsets", "answer_offsets"):
            if len(columns[name]) != pairs + 1:
                raise ValueError(f"{directory}: {name} holds {len(columns[name])} offsets for {pairs} pairs")
        return cls(columns, meta)

    @classmethod
    def from_examples(cls, examples: Sequence) -> PretrainCorpus:
        """Examples already in memory (`PretrainExample`s) as an in-memory corpus."""
        with tempfile.TemporaryDirectory(prefix="xmodal-corpus-") as tmp:
            writer = _Writer(Path(tmp))
            for e in examples:
                writer.add(e.img_id, e.source, [e.sentence], None if e.label is None else [e.label])
            writer.close("")
            return _in_memory(cls.open(tmp))

    # ---- pickling: a mapped corpus travels as its directory (its Mapped columns), rows as data
    def __getstate__(self) -> dict:
        return {"columns": self.columns, "meta": self.meta, "rows": self.rows}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["columns"], state["meta"], state["rows"])

    # ---- pairs
    def __len__(self) -> int:
        return len(self.columns["image"]) if self.rows is None else len(self.rows)

    def base(self, indices) -> np.ndarray:
        """Positions in the columns of pairs `indices`."""
        indices = np.asarray(indices, dtype=np.int64)
        return indices if self.rows is None else self.rows[indices]

    def column(self, name: str) -> np.ndarray:
        """A per-pair column over the selected pairs (the mapped column itself when all are)."""
        col = self.columns[name]
        return col if self.rows is None else col[self.rows]

    def select(self, keep: np.ndarray) -> PretrainCorpus:
        """The pairs where boolean `keep` is set, in order."""
        return PretrainCorpus(self.columns, self.meta, self.base(np.nonzero(keep)[0]))

    def image_ids(self, indices) -> list[str]:
        images = self.images
        return [images[i] for i in self.columns["image"][self.base(indices)].tolist()]

    def source_names(self, indices) -> list[str]:
        sources = self.sources
        return [sources[i] for i in self.columns["source"][self.base(indices)].tolist()]

    def used_images(self) -> np.ndarray:
        """Indices into the image table of the images the selected pairs use, ascending."""
        if self.rows is None:
            return np.arange(len(self.images))
        return np.unique(self.columns["image"][self.rows])

    def sentences(self, start: int, stop: int) -> list[str]:
        """The sentences of pairs start..stop-1 (positions in the columns, not through `rows`)."""
        offsets, text = self.columns["text_offsets"], self.columns["text"]
        lo, hi = int(offsets[start]), int(offsets[stop])
        chunk = bytes(text[lo:hi])
        cuts = (offsets[start : stop + 1] - lo).tolist()
        return [chunk[a:b].decode("utf-8") for a, b in zip(cuts, cuts[1:], strict=False)]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        at = int(self.base(i % len(self)))
        label = None
        if self.columns["question"][at]:
            lo, hi = self.columns["answer_offsets"][at : at + 2]
            names = self.answer_names
            label = {
                names[a]: s
                for a, s in zip(
                    self.columns["answer_ids"][lo:hi].tolist(),
                    self.columns["answer_scores"][lo:hi].tolist(),
                    strict=True,
                )
            }
        return PretrainExample(
            self.images[int(self.columns["image"][at])],
            self.sentences(at, at + 1)[0],
            self.sources[int(self.columns["source"][at])],
            label,
        )

    # ---- answers
    def answer_counts(self, normalize) -> dict[str, int]:
        """For each answer as `normalize` gives it, the number of selected questions listing it."""
        from collections import Counter

        norm_names: dict[str, int] = {}
        norm_of = np.array(
            [norm_names.setdefault(normalize(a), len(norm_names)) for a in self.answer_names], np.int64
        )
        width = max(len(norm_names), 1)
        counts = np.zeros(width, np.int64)
        for lo in range(0, len(self), PAIRS_STEP):
            pairs, ids, _ = self._entries(lo, min(lo + PAIRS_STEP, len(self)))
            if not ids.size:
                continue
            keys = np.sort(pairs * width + norm_of[ids])  # np.unique hashes: 20x slower
            keys = keys[np.concatenate([[True], keys[1:] != keys[:-1]])]
            counts += np.bincount(keys % width, minlength=width)
        names = list(norm_names)
        return Counter({names[k]: int(n) for k, n in enumerate(counts.tolist()) if n})

    def _entries(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every answer entry of selected pairs lo..hi-1: (pair index - lo, answer id, score)."""
        offsets = self.columns["answer_offsets"]
        if self.rows is None:  # consecutive entries: slices of the mapped columns
            bounds = np.asarray(offsets[lo : hi + 1], dtype=np.int64)
            pairs = np.repeat(np.arange(hi - lo, dtype=np.int64), np.diff(bounds))
            first, last = int(bounds[0]), int(bounds[-1])
            return pairs, self.columns["answer_ids"][first:last], self.columns["answer_scores"][first:last]
        at = self.rows[lo:hi]
        start, stop = offsets[at], offsets[at + 1]
        counts = stop - start
        pairs = np.repeat(np.arange(hi - lo, dtype=np.int64), counts)
        starts = np.repeat(start - (np.cumsum(counts) - counts), counts)
        entry = starts + np.arange(int(counts.sum()), dtype=np.int64)
        return (
            pairs,
            np.asarray(self.columns["answer_ids"][entry]),
            np.asarray(self.columns["answer_scores"][entry]),
        )

    def answer_labels(self, table) -> PairAnswers:
        """Each selected pair's answers as labels of `table` (`AnswerTable.labels`: answers not in the
        table left out, the best score, at least 0, for answers sharing a label), flat. Made PAIRS_STEP
        pairs at a time: the sorts' scratch arrays stay small whatever the corpus's size."""
        lookup = np.array([table.get(a, -1) for a in self.answer_names] or [-1], dtype=np.int64)
        counts = np.zeros(len(self), np.int64)
        out_labels, out_scores = [], []
        for lo in range(0, len(self), PAIRS_STEP):
            hi = min(lo + PAIRS_STEP, len(self))
            pairs, ids, scores = self._entries(lo, hi)
            labels = lookup[ids] if ids.size else np.zeros(0, np.int64)
            known = labels >= 0
            pairs, labels, scores = pairs[known], labels[known], np.asarray(scores)[known]
            position = np.arange(len(pairs))
            # group each pair's entries by label: first position and best score per group
            order = np.lexsort((position, labels, pairs))
            pairs, labels, scores, position = pairs[order], labels[order], scores[order], position[order]
            start = np.ones(len(pairs), bool)
            start[1:] = (pairs[1:] != pairs[:-1]) | (labels[1:] != labels[:-1])
            starts = np.nonzero(start)[0]
            best = np.maximum(np.maximum.reduceat(scores, starts), 0.0) if starts.size else scores[:0]
            g_pairs, g_labels, g_first = pairs[starts], labels[starts], position[starts]
            keep = np.lexsort((g_first, g_pairs))
            out_labels.append(g_labels[keep].astype(np.int64))
            out_scores.append(best[keep].astype(np.float32))
            counts[lo:hi] = np.bincount(g_pairs, minlength=hi - lo)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        labels = np.concatenate(out_labels) if out_labels else np.zeros(0, np.int64)
        scores = np.concatenate(out_scores) if out_scores else np.zeros(0, np.float32)
        return PairAnswers(labels, scores, offsets)


class PairAnswers:
    """Each pair's (label, soft score) answers, flat with offsets; `gather` gives a batch's (B, K) arrays,
    K the most answers any pair has (at least 1)."""

    def __init__(self, labels: np.ndarray, scores: np.ndarray, offsets: np.ndarray):
        self.labels, self.scores, self.offsets = labels, scores, offsets
        counts = np.diff(offsets)
        self.width = max(1, int(counts.max(initial=0)))

    @classmethod
    def from_lists(cls, answers: Sequence[Sequence[tuple[int, float]]]) -> PairAnswers:
        counts = np.array([len(a) for a in answers], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        labels = np.array([label for a in answers for label, _ in a], dtype=np.int64)
        scores = np.array([score for a in answers for _, score in a], dtype=np.float32)
        return cls(labels, scores, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def gather(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(B, K) int64 labels (-100 pads) and float32 soft scores of pairs `indices`."""
        lo = self.offsets[indices]
        counts = self.offsets[indices + 1] - lo
        inside = np.arange(self.width)[None, :] < counts[:, None]
        at = np.minimum(lo[:, None] + np.arange(self.width)[None, :], max(len(self.labels) - 1, 0))
        if not len(self.labels):
            return np.full(inside.shape, -100, np.int64), np.zeros(inside.shape, np.float32)
        return (
            np.where(inside, self.labels[at], -100).astype(np.int64),
            np.where(inside, self.scores[at], 0.0).astype(np.float32),
        )


def _in_memory(corpus: PretrainCorpus) -> PretrainCorpus:
    columns = {k: np.array(v) for k, v in corpus.columns.items()}
    return PretrainCorpus(columns, corpus.meta, corpus.rows)


def load_corpus(paths: Sequence[str | Path], cache_dir: str | Path | None) -> PretrainCorpus:
    """The pairs of the community JSON files `paths`: converted once into `cache_dir` (keyed by the files'
    paths, sizes and mtimes; written to a temporary folder, then renamed) and mapped from there, so a
    second run only maps them. No `cache_dir`: converted into memory."""
    for p in paths:
        try:
            regular_file(p, "JSON file")
        except FileNotFoundError as exc:
            raise ValueError(str(exc)) from None
    key = source_key(paths)
    if cache_dir is None:
        with tempfile.TemporaryDirectory(prefix="xmodal-corpus-") as tmp:
            convert(paths, Path(tmp), key)
            return _in_memory(PretrainCorpus.open(tmp))
    cache_dir = Path(cache_dir)
    final = cache_dir / f"corpus-{key[:32]}"
    if final.exists():
        if not final.is_dir() or stat.S_ISLNK(os.lstat(final).st_mode):
            raise ValueError(
                f"corpus cache {final} is not a folder; remove it or choose another cache folder"
            )
        try:
            corpus = PretrainCorpus.open(final)
            if corpus.key == key:
                return corpus
            problem = "for other files"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problem = f"unreadable ({exc})"
        log.warning("corpus cache %s is %s: converting again", final, problem)
        shutil.rmtree(final, ignore_errors=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = _new_folder(final)
    try:
        convert(paths, tmp, key)
        try:
            os.rename(tmp, final)
        except OSError:  # another process (a torchrun rank) put it there first
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s into %s", ", ".join(str(p) for p in paths), final)
    return PretrainCorpus.open(final)


def corpus_texts(
    corpus: PretrainCorpus, tokenizer, max_length: int, cache_dir: str | Path | None, chunk: int = 65536
):
    """The corpus's sentences tokenised (`EncodedTexts`, indexed like the corpus): read back from
    `cache_dir` when it holds them for this corpus, vocabulary and length limit, else tokenised a chunk
    at a time and written there (a temporary file, then renamed)."""
    from pipelines.data.text import EncodedTexts
    from pipelines.data.token_cache import cache_key

    pairs = len(corpus.columns["image"])
    vocab_size = len(tokenizer.get_vocab())
    key = cache_key(tokenizer, [corpus.key], max_length)[:32]
    final = None if cache_dir is None or not corpus.key else Path(cache_dir) / f"corpus-tokens-{key}"
    if final is not None and final.is_dir():
        try:
            meta = json.loads((final / "meta.json").read_text())
            total = int(meta["ids"])
            problem = _tokens_problem(final, total, pairs, max_length, vocab_size)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problem = f"unreadable ({exc})"
        if problem is None:
            ids = map_column(final / "ids.bin", np.int32, total)
            return EncodedTexts.of(ids, map_column(final / "offsets.bin", np.int64, pairs + 1), corpus.rows)
        log.warning("token cache %s is %s: tokenising again", final, problem)
        shutil.rmtree(final, ignore_errors=True)
    encode = _encoder(tokenizer, max_length)
    parent = Path(cache_dir) if final is not None else None
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_folder(final) if final is not None else Path(tempfile.mkdtemp(prefix="xmodal-tokens-"))
    try:
        total = 0
        with open(tmp / "ids.bin", "wb") as ids_fh, open(tmp / "offsets.bin", "wb") as off_fh:
            off_fh.write(np.zeros(1, np.int64).tobytes())
            for sents in _sentence_chunks(corpus, chunk):
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
            return EncodedTexts.of(ids, offsets, corpus.rows)
        try:
            os.rename(tmp, final)
        except OSError:  # another process (a torchrun rank) put it there first
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ids = map_column(final / "ids.bin", np.int32, total)
    return EncodedTexts.of(ids, map_column(final / "offsets.bin", np.int64, pairs + 1), corpus.rows)


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


# read in steps of this many items through the file, not the map: a whole pass over a mapped column
# would leave all its pages counted in this process's RSS
STEP = 1 << 22


def _sentence_chunks(corpus: PretrainCorpus, chunk: int) -> Iterator[list[str]]:
    """Every pair's sentence (all pairs of the columns, in order), `chunk` at a time."""
    pairs = len(corpus.columns["image"])
    text = corpus.columns["text"]
    if not isinstance(text, Mapped):
        for start in range(0, pairs, chunk):
            yield corpus.sentences(start, min(start + chunk, pairs))
        return
    offsets_path = Path(corpus.columns["text_offsets"].filename)
    with open(text.filename, "rb") as fh:
        for start in range(0, pairs, chunk):
            stop = min(start + chunk, pairs)
            cuts = np.fromfile(offsets_path, np.int64, stop - start + 1, offset=start * 8)
            fh.seek(int(cuts[0]))
            data = fh.read(int(cuts[-1] - cuts[0]))
            cuts = (cuts - cuts[0]).tolist()
            yield [data[a:b].decode("utf-8") for a, b in zip(cuts, cuts[1:], strict=False)]


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


def _new_folder(final: Path) -> Path:
    """A fresh hidden folder beside `final`, to be renamed to it, with the permissions the umask gives
    (`mkdtemp`'s would keep other users of a shared cache out)."""
    tmp = final.with_name(f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}")
    tmp.mkdir()
    return tmp
