"""Text: BERT uncased WordPiece tokenizers (load, save, train a vocab), encoded sentences, padded ids."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from pipelines.data.json_rows import read_json

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
DEFAULT_VOCAB_SIZE = 30522  # bert-base-uncased
MIN_REAL_TOKENS = 1  # none at all is a failed download or an empty corpus, not a vocabulary
HUB_PROBE_TIMEOUT = 10.0  # seconds


def load_tokenizer(vocab: str | Path):
    """A `BertTokenizerFast` (lowercasing) from a vocab.txt, a directory holding one, or a hub id."""
    from transformers import BertTokenizerFast

    path = Path(vocab)
    if path.is_dir() and (path / "vocab.txt").is_file():
        path = path / "vocab.txt"
    if path.is_file():
        tokens = set(path.read_text(encoding="utf-8").splitlines())
        missing = [t for t in SPECIAL_TOKENS if t not in tokens]
        if missing:
            raise ValueError(
                f"vocab {path} lacks the special tokens {missing}; build one with `xmodal vocab build`"
            )
        # from_pretrained(directory) reads a vocab.txt the same way across transformers versions
        if path.name == "vocab.txt":
            return _checked(BertTokenizerFast.from_pretrained(str(path.parent), do_lower_case=True), path)
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copyfile(path, Path(tmp) / "vocab.txt")
            return _checked(BertTokenizerFast.from_pretrained(tmp, do_lower_case=True), path)
    if path.suffix == ".txt" or path.exists():
        raise FileNotFoundError(f"vocab {vocab}: no such vocab.txt; build one with `xmodal vocab build`")
    return _checked(_hub_tokenizer(str(vocab)), vocab)


def _hub_tokenizer(hub_id: str):
    """The hub tokenizer from the local cache, else after one quick probe of the hub: offline, the hub
    client would retry each file for minutes, and transformers then returns a tokenizer of the special
    tokens alone instead of failing."""
    import os

    from transformers import BertTokenizerFast

    cached = BertTokenizerFast.from_pretrained(hub_id, do_lower_case=True, local_files_only=True)
    if len(cached) > len(SPECIAL_TOKENS):
        return cached
    hint = (
        "pass a vocab.txt with --vocab (a run directory's vocab.txt works), or build one with "
        "`xmodal vocab build CORPUS... --out vocab.txt`"
    )
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise OSError(
            f"tokenizer {hub_id!r} is not in the local HuggingFace cache and HF_HUB_OFFLINE is set; {hint}"
        )
    import huggingface_hub

    try:
        huggingface_hub.model_info(hub_id, timeout=HUB_PROBE_TIMEOUT)
    except Exception as exc:  # no network, unknown id, gated repo: all end the same way for the user
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise OSError(
            f"cannot load tokenizer {hub_id!r} from the HuggingFace hub ({reason}); {hint}"
        ) from exc
    return BertTokenizerFast.from_pretrained(hub_id, do_lower_case=True)


def _checked(tokenizer, source):
    """Refuse a vocabulary of (almost) nothing but the special tokens: training on it is meaningless."""
    real = len(tokenizer) - len(SPECIAL_TOKENS)
    if real < MIN_REAL_TOKENS:
        raise ValueError(
            f"vocab {source} has {real} tokens besides the special ones (need at least {MIN_REAL_TOKENS}); "
            "build one with `xmodal vocab build CORPUS... --out vocab.txt`"
        )
    return tokenizer


TEXT_FIELDS = ("sent", "question", "caption", "captions", "sentence")  # a row's sentences, by task
ROW_SUFFIXES = (".json", ".jsonl", ".csv", ".tsv", ".parquet", ".arrow")


def corpus_texts(files: Sequence[str | Path]) -> Iterator[str]:
    """Sentences of text files (one per line), pre-training JSON (`sentf`), question rows (LXMERT's `sent`,
    or `question` in a JSON, JSON lines, CSV or Parquet file) and caption files (`{image, caption}` rows,
    Karpathy's dataset_*.json, COCO's captions_*.json)."""
    for f in files:
        f = Path(f)
        if f.suffix.lower() not in ROW_SUFFIXES and not f.is_dir():
            yield from _text_lines(f)
            continue
        data = read_json(f) if f.suffix.lower() == ".json" else None
        if isinstance(data, dict) and ("images" in data or "annotations" in data):
            from pipelines.data.captions import read_caption_file

            yield from (raw for image in read_caption_file(f) for raw in image.raw)
            continue
        yield from _row_texts(f, data)


def _row_texts(path: Path, data: object) -> Iterator[str]:
    """The sentences of a row file's rows (`data`: its JSON document, None: not read yet); a file with rows
    that hold no text is refused naming them all."""
    from pipelines.data.row_files import Row, RowProblems, json_cell, read_row_file

    if isinstance(data, list):
        rows = [Row(r if isinstance(r, dict) else {}, None, i + 1) for i, r in enumerate(data)]
    else:
        rows = read_row_file(path)
    problems = RowProblems(path)
    texts: list[str] = []
    for row in rows:
        found = [row.fields[k] for k in TEXT_FIELDS if row.fields.get(k) not in (None, "")]
        sentf = row.fields.get("sentf")
        found += [s for sents in (sentf.values() if isinstance(sentf, dict) else ()) for s in sents]
        cells = [json_cell(v) for v in found]
        found = [t for v in cells for t in (v if isinstance(v, list) else [v])]
        if not any(isinstance(t, str) and t.strip() for t in found):
            problems.add(row, f"no text (one of {', '.join(repr(k) for k in ('sentf', *TEXT_FIELDS))})")
        texts += [t for t in found if isinstance(t, str) and t.strip()]
    problems.raise_if_any("question rows (image, question, answer) or caption rows (image, caption)")
    yield from texts


def _text_lines(path: Path) -> Iterator[str]:
    """The non-empty lines of a UTF-8 text file; ValueError naming the file for a binary or non-UTF-8 one
    (a picture or a feature store given by mistake would otherwise train a vocabulary of noise)."""
    with path.open("rb") as fh:
        if b"\0" in fh.read(4096):
            raise ValueError(
                f"{path}: a binary file, not text; give text files (one sentence per line) or JSON"
            )
    with path.open(encoding="utf-8") as fh:
        try:
            yield from (line.strip() for line in fh if line.strip())
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not UTF-8 text ({exc.reason}); save it as UTF-8 text") from None


def build_vocab(
    corpus_files: Sequence[str | Path], out: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> Path:
    """Train a lowercase WordPiece vocab (BERT's normaliser and pre-tokeniser) and write vocab.txt."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, clean_text=True, handle_chinese_chars=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        continuing_subword_prefix="##",
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts(corpus_files), trainer=trainer)
    vocab = tok.get_vocab()
    if len(vocab) <= len(SPECIAL_TOKENS):
        raise ValueError(f"no text found in {[str(f) for f in corpus_files]}: cannot build a vocab")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(t + "\n" for t in sorted(vocab, key=vocab.__getitem__)), encoding="utf-8")
    return out


def save_tokenizer(tokenizer, directory: str | Path) -> None:
    """Write vocab.txt (what `load_tokenizer` and the original code read) and the tokenizer's own files."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_vocab(tokenizer, directory / "vocab.txt")
    tokenizer.save_pretrained(str(directory))


def write_vocab(tokenizer, path: str | Path) -> None:
    """The tokenizer's vocabulary as vocab.txt: one token per line, in id order."""
    vocab = tokenizer.get_vocab()
    Path(path).write_text("".join(t + "\n" for t in sorted(vocab, key=vocab.__getitem__)), encoding="utf-8")


def encode_text(tokenizer, sent: str, max_length: int) -> np.ndarray:
    """`[CLS] tokens [SEP]` ids, truncated to `max_length`."""
    return np.asarray(tokenizer(sent, truncation=True, max_length=max_length)["input_ids"], dtype=np.int64)


class EncodedTexts:
    """All sentences tokenized once up front, kept as one flat array plus offsets: no per-item tokenizer
    calls, and no per-sentence Python objects for forked DataLoader workers to copy on access.
    `cache_dir`: keep the ids there (pipelines.data.token_cache) and reuse them while the vocabulary and
    the sentences are unchanged."""

    def __init__(
        self,
        tokenizer,
        sents: Sequence[str],
        max_length: int,
        chunk: int = 65536,
        cache_dir: str | Path | None = None,
    ) -> None:
        from pipelines.data.token_cache import load_or_tokenize

        def tokenize() -> tuple[np.ndarray, np.ndarray]:
            pieces: list[np.ndarray] = []
            for start in range(0, len(sents), chunk):
                encoded = tokenizer(
                    list(sents[start : start + chunk]), truncation=True, max_length=max_length
                )
                pieces.extend(np.asarray(ids, dtype=np.int32) for ids in encoded["input_ids"])
            lengths = np.array([len(p) for p in pieces], dtype=np.int64)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            return (np.concatenate(pieces) if pieces else np.zeros(0, np.int32)), offsets

        self.ids, self.offsets = load_or_tokenize(tokenize, tokenizer, sents, max_length, cache_dir)
        self.rows: np.ndarray | None = None

    @classmethod
    def of(cls, ids: np.ndarray, offsets: np.ndarray, rows: np.ndarray | None = None) -> EncodedTexts:
        """Sentences already tokenised (flat `ids`, `offsets`); `rows`: sentence i is their `rows[i]`."""
        texts = cls.__new__(cls)
        texts.ids, texts.offsets, texts.rows = ids, offsets, rows
        return texts

    def __len__(self) -> int:
        return len(self.offsets) - 1 if self.rows is None else len(self.rows)

    def _at(self, indices) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64)
        return indices if self.rows is None else self.rows[indices]

    def __getitem__(self, i: int) -> np.ndarray:
        i = int(self._at(i))
        return self.ids[self.offsets[i] : self.offsets[i + 1]].astype(np.int64)

    def lengths(self, indices: np.ndarray) -> np.ndarray:
        """Token counts of sentences `indices`."""
        at = self._at(indices)
        return self.offsets[at + 1] - self.offsets[at]

    def padded(self, indices: np.ndarray, pad_id: int, width: int | None = None) -> np.ndarray:
        """(B, width) int64 ids of sentences `indices`, right-padded with `pad_id` (None = the longest)."""
        indices = self._at(indices)
        lengths = self.offsets[indices + 1] - self.offsets[indices]
        width = int(lengths.max(initial=1)) if width is None else width
        cols = np.arange(width)
        inside = cols[None, :] < lengths[:, None]
        at = np.minimum(self.offsets[indices][:, None] + cols[None, :], max(len(self.ids) - 1, 0))
        return np.where(inside, self.ids[at] if len(self.ids) else 0, pad_id).astype(np.int64)


def pad_text(seqs: list[np.ndarray], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids`, `attention_mask` (1 = real token) and zero `token_type_ids`."""
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.from_numpy(s)
        mask[i, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
