"""Caption data: `{image, caption}` rows, the Karpathy split JSON, COCO caption annotations, and the word
vocabulary."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch.utils.data import Dataset

from model.files import JSON_LIMIT, MAX_DEPTH, nesting_depth, read_json, read_text
from pipelines.data.columns import TABLE, TEXT, RowColumns, cached_arrays
from pipelines.data.example_batch import ExampleBatch, as_batch
from pipelines.data.image_refs import image_ref
from pipelines.data.row_files import DATASETS_SUFFIXES, json_cell, kind_of, rows_and_problems

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0..3, matching model.captioning.CaptionConfig's defaults
MAX_LENGTH = 16
VOCAB_FILE = "vocab.json"  # a captioning run directory's vocabulary
COUNT_THRESHOLD = 5
KARPATHY_SPLITS = {"train": "train", "restval": "train", "val": "val", "test": "test"}
ANY_SPLIT = ""  # caption rows without a split field: the split their file is given as
SPLIT_SEPARATOR = ":"  # `dataset_coco.json:test` = the test images of a Karpathy file
CAPTION_IMAGE_FIELDS = ("image", "img_id", "file_name", "filename", "image_path")
ROW_SUFFIXES = DATASETS_SUFFIXES | {".csv", ".tsv", ".jsonl"}
CAPTION_EXPECTED = '{"image": "sub/a.jpg", "caption": "a red car in the snow"} (or captions: [...], split)'


class CaptionDataError(ValueError):
    """A caption file or one of its records is malformed; the message names which and how to fix it."""


@dataclass
class CaptionImage:
    """One image with its reference captions (tokenised and raw)."""

    image_id: int | str  # the COCO id when the file gives one, else the image's reference
    filename: str
    split: str  # train (restval included), val, test, or ANY_SPLIT for rows that name none
    captions: list[list[str]]
    raw: list[str]
    filepath: str = ""


def tokenize_caption(raw: str) -> list[str]:
    """Lower-case words without punctuation, as Karpathy's preprocessing produced the `tokens`."""
    return re.findall(r"[a-z0-9]+(?:'[a-z]+)?", raw.lower())


def _load_json(path: str | Path) -> object:
    path = Path(path)
    if not path.exists():
        raise CaptionDataError(f"{path}: no such file; pass the path to the caption JSON")
    try:
        return read_json(path, "caption JSON")
    except ValueError as err:
        raise CaptionDataError(str(err)) from None


def read_karpathy_split(path: str | Path) -> list[CaptionImage]:
    """Images of `dataset_coco.json` (Karpathy & Fei-Fei's split); `restval` counts as train."""
    data = _load_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise CaptionDataError(
            f"{path}: expected an object with an 'images' list (Karpathy's dataset_coco.json)"
        )
    images = []
    for index, row in enumerate(data["images"]):
        where = f"{path}: images[{index}]"
        if not isinstance(row, dict):
            raise CaptionDataError(f"{where} is not an object")
        missing = [k for k in ("filename", "sentences") if k not in row]
        if missing:
            raise CaptionDataError(f"{where} lacks field(s) {missing}; is this Karpathy's dataset_coco.json?")
        split = KARPATHY_SPLITS.get(row.get("split", "train"))
        if split is None:
            raise CaptionDataError(
                f"{where} has split {row['split']!r}; expected one of {sorted(KARPATHY_SPLITS)}"
            )
        captions, raw = [], []
        if not isinstance(row["sentences"], list):
            kind = type(row["sentences"]).__name__
            raise CaptionDataError(f"{where}.sentences is {kind}; it must be a list of sentence objects")
        for s, sentence in enumerate(row["sentences"]):
            if not isinstance(sentence, dict) or not ("tokens" in sentence or "raw" in sentence):
                raise CaptionDataError(f"{where}.sentences[{s}] needs 'tokens' or 'raw'")
            tokens = sentence.get("tokens")
            if tokens is not None and (
                not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens)
            ):
                raise CaptionDataError(f"{where}.sentences[{s}].tokens must be a list of strings")
            if "raw" in sentence and not isinstance(sentence["raw"], str):
                raise CaptionDataError(f"{where}.sentences[{s}].raw must be a string")
            text = sentence["raw"] if "raw" in sentence else " ".join(tokens or [])
            if tokens is None:
                tokens = tokenize_caption(text)
            captions.append([t.lower() for t in tokens])
            raw.append(text)
        image_id = row.get("cocoid", row.get("imgid"))
        if image_id is None:  # Flickr-style files without COCO ids: the image names itself
            image_id = _karpathy_ref(row)
        elif not isinstance(image_id, int) or isinstance(image_id, bool):
            raise CaptionDataError(f"{where} has a non-integer cocoid {image_id!r}")
        images.append(
            CaptionImage(image_id, str(row["filename"]), split, captions, raw, str(row.get("filepath", "")))
        )
    return images


def read_coco_captions(path: str | Path, split: str = "train") -> list[CaptionImage]:
    """Images of a COCO caption annotation file (`captions_train2014.json`), all tagged `split`."""
    data = _load_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("annotations"), list):
        raise CaptionDataError(
            f"{path}: expected an object with an 'annotations' list (COCO captions_*.json)"
        )
    filenames: dict[int, str] = {}
    listed: set[int] = set()
    for index, image in enumerate(data.get("images", [])):
        # pycocotools (COCO.createIndex, loadRes) reads an image's 'id' alone; 'file_name' is optional
        if not isinstance(image, dict) or "id" not in image:
            raise CaptionDataError(f"{path}: images[{index}] needs an 'id'")
        listed.add(int(image["id"]))
        if "file_name" in image:
            filenames[int(image["id"])] = str(image["file_name"])
    raw: dict[int, list[str]] = {}
    for index, ann in enumerate(data["annotations"]):
        if not isinstance(ann, dict) or "image_id" not in ann or not isinstance(ann.get("caption"), str):
            raise CaptionDataError(f"{path}: annotations[{index}] needs 'image_id' and a string 'caption'")
        raw.setdefault(int(ann["image_id"]), []).append(ann["caption"].strip())
    unknown = sorted(set(raw) - listed) if listed else []
    if unknown:
        raise CaptionDataError(f"{path}: annotations name image id(s) {unknown[:3]} missing from 'images'")
    return [
        CaptionImage(
            image_id,
            filenames.get(image_id, f"{image_id:012d}.jpg"),
            split,
            [tokenize_caption(c) for c in captions],
            captions,
        )
        for image_id, captions in raw.items()
    ]


class Vocabulary:
    """Words kept by count, with `<pad> <bos> <eos> <unk>` as ids 0..3."""

    def __init__(self, words: Sequence[str]):
        self.words = list(SPECIAL_TOKENS) + [w for w in words if w not in SPECIAL_TOKENS]
        self.index = {w: i for i, w in enumerate(self.words)}
        if len(self.index) != len(self.words):
            raise ValueError("vocabulary words must be unique")

    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3

    @classmethod
    def build(cls, captions: Iterable[Sequence[str]], count_threshold: int = COUNT_THRESHOLD) -> Vocabulary:
        """Words seen at least `count_threshold` times in the (training) captions, most frequent first."""
        counts = Counter(w for caption in captions for w in caption)
        kept = sorted((w for w, c in counts.items() if c >= count_threshold), key=lambda w: (-counts[w], w))
        return cls(kept)

    def __len__(self) -> int:
        return len(self.words)

    @property
    def pad_token_id(self) -> int:
        """The padding id under the name the text tokenizers give it."""
        return self.pad_id

    def encode(self, tokens: Sequence[str], max_length: int = MAX_LENGTH) -> list[int]:
        """`<bos>`, at most `max_length` words (unknown → `<unk>`), `<eos>`."""
        ids = [self.index.get(t, self.unk_id) for t in tokens[:max_length]]
        return [self.bos_id, *ids, self.eos_id]

    def decode(self, ids: Iterable[int]) -> str:
        """Words up to the first `<eos>`, skipping `<bos>`/`<pad>`."""
        words = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i in (self.pad_id, self.bos_id):
                continue
            words.append(self.words[i])
        return " ".join(words)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"words": self.words}, indent=0), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Vocabulary:
        """A caption run's vocab.json (or its directory), or a vocab.txt of one word per line: the one
        `xmodal vocab build` writes serves too (its [PAD]-style tokens and ##pieces are left out)."""
        path = Path(path)
        if path.is_dir():
            path = path / VOCAB_FILE if (path / VOCAB_FILE).is_file() else path / "vocab.txt"
        if path.suffix.lower() == ".txt":
            lines = read_text(path, "vocabulary").splitlines()
            words = [w.strip() for w in lines if w.strip() and not w.startswith("##")]
            return cls(list(dict.fromkeys(w for w in words if not re.fullmatch(r"\[[A-Z]+\]", w))))
        data = _load_json(path)
        words = data.get("words") if isinstance(data, dict) else None
        if not isinstance(words, list) or list(words[: len(SPECIAL_TOKENS)]) != list(SPECIAL_TOKENS):
            raise CaptionDataError(
                f"{path}: not a caption vocabulary (expected 'words' starting {SPECIAL_TOKENS})"
            )
        return cls(words[len(SPECIAL_TOKENS) :])


@dataclass(frozen=True)
class CaptionExample:
    """One image to caption: its COCO id (`key`), its feature-store id, and its reference captions."""

    image_id: int | str  # the COCO id, else the image's reference
    img_id: str  # the image as the file names it; looked up by pipelines.data.image_refs' rule
    label: tuple[tuple[str, ...], ...] | None  # tokenised references; None when unknown
    raw: tuple[str, ...] = ()

    @property
    def key(self) -> int | str:
        return self.image_id

    @property
    def images(self) -> tuple[str, ...]:
        return (self.img_id,)


def split_spec(spec: str | Path, default: str | None) -> tuple[Path, str | None]:
    """`FILE` or `FILE:SPLIT` (train, val or test of a Karpathy file) → (path, split or `default`)."""
    text = str(spec)
    head, sep, tail = text.rpartition(SPLIT_SEPARATOR)
    if sep and tail in ("train", "val", "test") and not Path(text).exists():
        return Path(head), tail
    return Path(text), default


def _karpathy_ref(row: dict) -> str:
    """The image a Karpathy row names: `filepath/filename` when it has a folder, else `filename`."""
    folder = str(row.get("filepath") or "").strip("/")
    return f"{folder}/{row['filename']}" if folder else str(row["filename"])


def read_caption_rows(path: str | Path) -> list[CaptionImage]:
    """Images of `{image, caption}` rows (or `{image, captions: [...]}`; optional `split` and COCO
    `image_id`) in a JSON list, JSON lines, CSV or Parquet file; rows of one image gather its captions.
    Every malformed row is named in one refusal."""
    path = Path(path)
    rows, problems = rows_and_problems(path)  # a CSV's malformed lines, named with the rows' problems
    images: dict[str, CaptionImage] = {}
    for row in rows:
        fields = row.fields
        issues = []
        img_field = next((k for k in CAPTION_IMAGE_FIELDS if fields.get(k) not in (None, "")), None)
        ref = image_ref(fields[img_field]) if img_field else None
        if img_field is None:
            issues.append("no 'image'")
        elif ref is None:
            issues.append(f"{img_field!r} is {kind_of(fields[img_field])} (give the image's file name)")
        raw = fields.get("caption", fields.get("captions", fields.get("sentence")))
        raw = json_cell(raw)
        texts = [raw] if isinstance(raw, str) else raw
        if raw is None or raw == "":
            issues.append("no 'caption'")
        elif (
            not isinstance(texts, list)
            or not texts
            or not all(isinstance(t, str) and t.strip() for t in texts)
        ):
            issues.append(f"'caption' is {kind_of(raw)} (give the caption as text, or 'captions' as a list)")
        # a row without a split belongs to whichever split its file is given as (--train or --valid)
        split = KARPATHY_SPLITS.get(str(fields["split"])) if fields.get("split") else ANY_SPLIT
        if split is None:
            issues.append(f"'split' is {fields['split']!r} (one of {sorted(KARPATHY_SPLITS)})")
        coco_id = fields.get("cocoid", fields.get("image_id") if img_field != "image_id" else None)
        if coco_id not in (None, "") and not (isinstance(coco_id, int) or str(coco_id).isdigit()):
            issues.append(f"'image_id' is {coco_id!r} (give the COCO id as a whole number, or leave it out)")
        if issues:
            for issue in issues:
                problems.add(row, issue)
            continue
        image = images.get(ref)
        if image is None:
            image_id = int(coco_id) if coco_id not in (None, "") else ref
            image = images[ref] = CaptionImage(image_id, ref, split, [], [])
        elif image.split != split:
            problems.add(row, f"image {ref!r} is in split {image.split} on an earlier line, {split} here")
            continue
        for text in texts:
            image.raw.append(text.strip())
            image.captions.append(tokenize_caption(text))
    problems.raise_if_any(CAPTION_EXPECTED)
    return list(images.values())


def read_caption_file(path: str | Path, split: str | None = None) -> list[CaptionImage]:
    """Images of a Karpathy split JSON, a COCO caption annotation file, or caption rows (`split` None =
    all; rows without a `split` field are in every split)."""
    path = Path(path)
    if path.is_dir() or path.suffix.lower() in ROW_SUFFIXES:
        images = read_caption_rows(path)
    else:
        data = _peek_json(path)
        if isinstance(data, dict) and "annotations" in data and "images" in data and "dataset" not in data:
            return read_coco_captions(path, split or "train")
        images = (
            read_karpathy_split(path)
            if isinstance(data, dict) and "images" in data
            else read_caption_rows(path)
        )
    return images if split is None else [im for im in images if im.split in (split, ANY_SPLIT)]


def _peek_json(path: Path) -> object:
    """The JSON document in `path`, or None for JSON lines (read as rows)."""
    if not path.is_file():
        raise CaptionDataError(f"{path}: no such file; pass the path to the caption file")
    # caption files nest a few levels: the 64-level rule every JSON reader here keeps
    too_deep = f"{path}: JSON nested deeper than {MAX_DEPTH} levels; fix the file"
    try:
        data = json.loads(read_text(path, "caption file", JSON_LIMIT))
    except (json.JSONDecodeError, ValueError):  # not UTF-8 either: read as rows, which say what is wrong
        return None
    except RecursionError:
        raise CaptionDataError(too_deep) from None
    if nesting_depth(data) > MAX_DEPTH:
        raise CaptionDataError(too_deep)
    return data


def load_caption_examples(
    specs: str | Path | Iterable[str | Path], split: str | None = None
) -> list[CaptionExample]:
    """Caption examples of `FILE[:SPLIT]` specs; a Karpathy file without `:SPLIT` gives `split`'s images."""
    out: list[CaptionExample] = []
    seen: dict[int, Path] = {}
    for spec in [specs] if isinstance(specs, (str, Path)) else specs:
        path, chosen = split_spec(spec, split)
        images = read_caption_file(path, chosen)
        if not images:
            raise CaptionDataError(
                f"{path}: no images in split {chosen!r}; pass FILE:train, FILE:val or FILE:test, or give "
                "the rows a 'split' field"
            )
        for im in images:
            if im.image_id in seen:
                raise CaptionDataError(f"{path}: image {im.image_id} repeats (first in {seen[im.image_id]})")
            seen[im.image_id] = path
            refs = tuple(tuple(c) for c in im.captions if c)
            ref = _karpathy_ref({"filepath": im.filepath, "filename": im.filename})
            out.append(CaptionExample(im.image_id, ref, refs or None, tuple(im.raw)))
    return out


def load_caption_rows(
    specs: str | Path | Iterable[str | Path], split: str | None = None, cache_dir: str | Path | None = None
) -> CaptionRows:
    """The images `load_caption_examples` reads, as columns: converted once into `cache_dir` (keyed by the
    files and the splits asked for) and mapped from there; in memory without one."""
    specs = [specs] if isinstance(specs, (str, Path)) else list(specs)
    paths = [split_spec(spec, split)[0] for spec in specs]
    if not all(p.is_file() for p in paths):  # a folder, or a missing file refused while reading
        cache_dir = None
    salt = [str(s) for s in specs] + [split]
    return CaptionRows.load(
        lambda: map(_caption_columns, load_caption_examples(specs, split)), paths, cache_dir, salt
    )


def _caption_columns(e: CaptionExample) -> dict:
    refs = None if e.label is None else [list(c) for c in e.label]
    return {
        "key": str(e.image_id),
        "key_int": isinstance(e.image_id, int),
        "image": e.img_id,
        "refs": json.dumps([refs, list(e.raw)], ensure_ascii=False),
    }


class CaptionRows(RowColumns):
    """Images to caption as columns (see `RowColumns`); item i is image i's `CaptionExample`, built on
    demand."""

    SCHEMA: ClassVar[dict] = {
        "key": TEXT,  # the COCO id or the image's reference, as text; `key_int`: it was a number
        "key_int": np.bool_,
        "image": TABLE,
        "refs": TEXT,  # JSON [tokenised references or null, raw captions]
    }
    KIND = "caption-rows"
    VERSION = 1
    IMAGES = ("image",)

    @classmethod
    def from_examples(cls, examples: Sequence[CaptionExample]) -> CaptionRows:
        return cls.build(map(_caption_columns, examples))

    def keys(self, indices) -> list[int | str]:
        flags = self.columns["key_int"][self.base(indices)].tolist()
        return [int(k) if n else k for k, n in zip(self.texts("key", indices), flags, strict=True)]

    def references(self, indices) -> list[tuple[tuple[tuple[str, ...], ...] | None, tuple[str, ...]]]:
        """(tokenised references or None, raw captions) of rows `indices`."""
        out = []
        for text in self.texts("refs", indices):
            refs, raw = json.loads(text)
            out.append((None if refs is None else tuple(tuple(c) for c in refs), tuple(raw)))
        return out

    def example(self, i: int) -> CaptionExample:
        label, raw = self.references([i])[0]
        return CaptionExample(self.keys([i])[0], self.image_ids([i])[0], label, raw)

    def encoded(
        self, vocab: Vocabulary, max_length: int, cache_dir: str | Path | None
    ) -> dict[str, np.ndarray]:
        """Every image's references encoded (`Vocabulary.encode`; all rows of the columns, index them with
        `base`): flat int32 `ids`, `caption_offsets` into them, `image_offsets` into the captions; kept
        beside the columns in `cache_dir` when they are mapped."""
        whole = self.whole()

        def compute() -> dict[str, np.ndarray]:
            ids, caption_ends, image_ends = [], [], []
            for start in range(0, len(whole), 8192):
                for label, _ in whole.references(np.arange(start, min(start + 8192, len(whole)))):
                    for c in label or ():
                        ids += vocab.encode(c, max_length)
                        caption_ends.append(len(ids))
                    image_ends.append(len(caption_ends))
            return {
                "ids": np.array(ids, np.int32),
                "caption_offsets": np.array([0, *caption_ends], np.int64),
                "image_offsets": np.array([0, *image_ends], np.int64),
            }

        def check(arrays: dict[str, np.ndarray]) -> None:
            ids, caps, imgs = arrays["ids"], arrays["caption_offsets"], arrays["image_offsets"]
            if len(imgs) != len(whole) + 1 or imgs[0] != 0 or imgs[-1] != len(caps) - 1:
                raise ValueError("image offsets that do not index its captions")
            outside = len(ids) and (ids.min() < 0 or ids.max() >= len(vocab))
            if caps[0] != 0 or caps[-1] != len(ids) or outside:
                raise ValueError("captions that are not the vocabulary's ids")

        key = hashlib.sha256(json.dumps([self.key, vocab.words, max_length]).encode()).hexdigest()
        return cached_arrays(cache_dir if self.key else None, f"{self.KIND}-ids", key, compute, check)


class CaptionDataset(Dataset):
    """Images with their encoded reference captions (`<bos> w… <eos>`, encoded once into flat arrays),
    read a micro-batch at a time (`__getitems__`: the regions in one read transaction). Item i: image i
    alone. `cache_dir`: where mapped rows keep their encoded captions."""

    def __init__(
        self,
        examples: Sequence[CaptionExample],
        features,
        vocab: Vocabulary,
        max_length: int = MAX_LENGTH,
        cache_dir: str | Path | None = None,
    ):
        self.examples = examples if isinstance(examples, CaptionRows) else CaptionRows.from_examples(examples)
        self.features = features
        encoded = self.examples.encoded(vocab, max_length, cache_dir)
        self.ids, self.caption_offsets = encoded["ids"], encoded["caption_offsets"]
        self.image_offsets = encoded["image_offsets"]

    def __len__(self) -> int:
        return len(self.examples)

    def _captions(self, i: int) -> list[np.ndarray]:
        lo, hi = self.image_offsets[i : i + 2].tolist()
        cuts = self.caption_offsets[lo : hi + 1].tolist()
        ids = np.asarray(self.ids)  # slices without a memmap object each
        return [ids[a:b].astype(np.int64) for a, b in zip(cuts, cuts[1:], strict=False)]

    def request_ahead(self, indices) -> None:
        """Ask the store now for the regions of images `indices` (`FeatureReader.request_ahead`)."""
        self.features.request_ahead(self.examples.image_ids(np.asarray(indices, dtype=np.int64)))

    def __getitems__(self, indices) -> ExampleBatch:
        idx = np.asarray(indices, dtype=np.int64)
        return ExampleBatch.read(
            self.features,
            ids=self.examples.keys(idx),
            images=self.examples.image_ids(idx),
            captions=[self._captions(i) for i in self.examples.base(idx).tolist()],
        )

    def __getitem__(self, i: int) -> ExampleBatch:
        return self.__getitems__([i])


def collate_captions(
    batch: ExampleBatch | list[ExampleBatch],
    rng: np.random.Generator | None = None,
    pad_id: int = 0,
    per_image: int = 1,
) -> dict:
    """Regions padded to the batch's largest set (features as stored, widened on the device); with
    references, `per_image` per image (one drawn with `rng`, the first without; several: a run of
    `per_image` consecutive references from a random start, or draws with replacement when an image has
    fewer, as self-critical.pytorch's loader) as `input_ids` = caption[:-1] and `labels` = caption[1:],
    padded with `pad_id`; with `per_image` > 1, `caption_rows` says which image each caption row is of."""
    batch = as_batch(batch, pad_id)
    out = batch.regions.model_inputs()
    out["ids"] = batch.ids
    if batch.captions is not None and all(batch.captions):
        chosen = [c for caps in batch.captions for c in _pick(caps, per_image, rng)]
        lengths = np.array([len(c) for c in chosen])
        padded = np.full((len(chosen), int(lengths.max())), pad_id, dtype=np.int64)
        padded[np.arange(padded.shape[1])[None, :] < lengths[:, None]] = np.concatenate(chosen)
        out["input_ids"] = torch.from_numpy(padded[:, :-1])
        out["labels"] = torch.from_numpy(padded[:, 1:])
        if per_image > 1:
            out["caption_rows"] = torch.arange(len(batch.captions)).repeat_interleave(per_image)
    return out


def _pick(captions: list, count: int, rng: np.random.Generator | None) -> list:
    if rng is None:
        return [captions[i % len(captions)] for i in range(count)]
    if count == 1:
        return [captions[int(rng.integers(len(captions)))]]
    if len(captions) < count:
        return [captions[int(rng.integers(len(captions)))] for _ in range(count)]
    start = int(rng.integers(len(captions) - count + 1))
    return captions[start : start + count]
