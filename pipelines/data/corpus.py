"""The pre-training corpus as memory-mapped columns: the community JSON converted once (streamed, in bounded
memory) into flat numpy arrays on disk that loader workers share without copying."""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model.files import regular_file
from pipelines.data import columns
from pipelines.data.answers import ROWS_STEP, PairAnswers, answer_counts, answer_labels, flat_entries
from pipelines.data.column_tokens import column_tokens
from pipelines.data.columns import Selection, cached_folder, map_column, text_chunks

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


PAIRS_STEP = ROWS_STEP  # pairs whose answers are sorted together


def sentence_hashes(sents: Iterable[bytes]) -> np.ndarray:
    """int64 hash of each UTF-8 sentence, the same in every process and run (Python's `hash` is salted)."""
    digest = b"".join(hashlib.blake2b(s, digest_size=8).digest() for s in sents)
    return np.frombuffer(digest, dtype="<i8").astype(np.int64)


def source_key(paths: Sequence[str | Path]) -> str:
    """sha256 of what the columns depend on: each file's resolved path, size, mtime and inode, in order."""
    return columns.source_key(paths, CORPUS_VERSION)


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


class PretrainCorpus(Selection, Sequence):
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
        return answer_counts(self.answer_names, self._entries, len(self), normalize, PAIRS_STEP)

    def _entries(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every answer entry of selected pairs lo..hi-1: (pair index - lo, answer id, score)."""
        c = self.columns
        return flat_entries(c["answer_offsets"], c["answer_ids"], c["answer_scores"], self.rows, lo, hi)

    def answer_labels(self, table) -> PairAnswers:
        """Each selected pair's answers as labels of `table` (see `answers.answer_labels`), flat, made
        PAIRS_STEP pairs at a time."""
        return answer_labels(self.answer_names, self._entries, len(self), table, PAIRS_STEP)


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
    final = Path(cache_dir) / f"corpus-{key[:32]}"

    def build(tmp: Path) -> None:
        convert(paths, tmp, key)
        log.info("converted %s into %s", ", ".join(str(p) for p in paths), final)

    return cached_folder(final, key, build, PretrainCorpus.open, "corpus")


def corpus_texts(
    corpus: PretrainCorpus, tokenizer, max_length: int, cache_dir: str | Path | None, chunk: int = 65536
):
    """The corpus's sentences tokenised (`EncodedTexts`, indexed like the corpus): read back from
    `cache_dir` when it holds them for this corpus, vocabulary and length limit, else tokenised a chunk
    at a time and written there (a temporary file, then renamed)."""
    pairs = len(corpus.columns["image"])

    def chunks(size: int) -> Iterator[list[str]]:
        return text_chunks(corpus.columns["text"], corpus.columns["text_offsets"], size)

    return column_tokens(
        corpus.key, "corpus-tokens", pairs, chunks, corpus.rows, tokenizer, max_length, cache_dir, chunk
    )
