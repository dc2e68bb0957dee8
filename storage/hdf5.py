"""HDF5 in and out: the bottom-up-attention-vqa layout, and xmodal's export layout (a superset of it)."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import h5py
import numpy as np

from storage.errors import BadInputError, DroppedInput, StoreFormatError
from storage.file_checks import regular_file
from storage.metadata import MAX_BOXES, MAX_FEATURE_DIM
from storage.reader import FeatureReader
from storage.records import CLASS_PROBS_DTYPE, UNKNOWN_LABEL, RegionFeatures

H5_FORMAT = "xmodal-region-features-h5"
H5_FORMAT_VERSION = 1
log = logging.getLogger(__name__)

_BLOCK = 64  # rows read per HDF5 call when importing
_BLOCK_BYTES = 64 << 20  # and at most this much of the widest dataset per call
_FIX = "check the file, or re-export it (`xmodal features export`)"
_LABEL_FIELDS = ("objects_id", "objects_conf", "attrs_id", "attrs_conf")


def read_hdf5(
    path: str | os.PathLike, ids: str | os.PathLike | None = None
) -> Iterator[tuple[str, RegionFeatures | BadInputError]]:
    """Stream (where, record or error) row by row from either layout; `ids` maps rows to image ids for
    the bottom-up-attention-vqa layout (found next to the file when not given)."""
    path = Path(path)
    with _opened(path) as f:
        if f.attrs.get("format") == H5_FORMAT:
            version = int(f.attrs.get("format_version", 0))
            if version > H5_FORMAT_VERSION:
                raise BadInputError(
                    f"{path}: HDF5 export format version {version} is newer than this xmodal reads "
                    f"({H5_FORMAT_VERSION}): upgrade xmodal"
                )
            if ids is not None:
                log.warning("%s: --ids %s ignored: an xmodal HDF5 export carries its own ids", path, ids)
            yield from _read_xmodal(f, path)
        elif "image_features" in f and "image_bb" in f:
            yield from _read_butd(f, path, *_row_ids(path, ids, f))
        else:
            raise BadInputError(
                f"{path}: neither an xmodal HDF5 export nor the bottom-up-attention-vqa layout "
                f"(image_features, image_bb, spatial_features); datasets found: {sorted(f.keys())}"
            )


def hdf5_source_provenance(path: str | os.PathLike) -> dict:
    """What produced an xmodal export's features (the exported store's provenance: detector, configs,
    weights), for the store it is imported into; {} for other layouts, which do not say."""
    with _opened(Path(path)) as f:
        if f.attrs.get("format") != H5_FORMAT or "meta" not in f.attrs:
            return {}
        try:
            meta = json.loads(f.attrs["meta"])
        except (TypeError, ValueError):
            return {}
    provenance = meta.get("provenance") if isinstance(meta, dict) else None
    if not isinstance(provenance, dict):
        return {}
    return {k: v for k, v in provenance.items() if k != "imported_from"}


def hdf5_max_boxes(path: str | os.PathLike) -> int:
    """The most boxes an image has in either layout: the padded width, or the longest pos_boxes span."""
    path = Path(path)
    with _opened(path) as f:
        if "pos_boxes" in f:
            pos = _spans(f, path)
            return int((pos[:, 1] - pos[:, 0]).max()) if len(pos) else 1
        if "image_bb" in f:
            return _width(_dataset(f, "image_bb", path, 3, whole=False), path)  # read checks the rest
    raise BadInputError(f"{path}: no image_bb dataset: not a feature HDF5 file")


@contextmanager
def _opened(path: Path) -> Iterator[h5py.File]:
    """The HDF5 file `path`, read-only; what h5py finds wrong with it (not HDF5, truncated, a missing
    dataset or row) is one BadInputError naming the file."""
    try:
        regular_file(path, 1 << 50, _FIX)
    except StoreFormatError as exc:
        raise BadInputError(str(exc)) from None
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise BadInputError(f"{path} is not a readable HDF5 file (h5py: {exc}); {_FIX}") from None
    try:
        with f:
            yield f
    except BadInputError:
        raise
    except (OSError, KeyError, IndexError, ValueError, TypeError) as exc:
        raise BadInputError(f"{path} cannot be read ({type(exc).__name__}: {exc}); {_FIX}") from None


def _dataset(
    f: h5py.File, name: str, path: Path, ndim: int, rows: int | None = None, whole: bool = True
) -> h5py.Dataset:
    """Dataset `name` of `ndim` dimensions (and `rows` rows), whose values were written (a dataset only
    declared reads as zeros, which would import as records of nothing); not `whole`: the rows of images
    without boxes may be unwritten, see `_row_written`."""
    ds = f.get(name)
    if not isinstance(ds, h5py.Dataset):
        raise BadInputError(f"{path}: no {name} dataset; {_FIX}")
    if ds.ndim != ndim or (rows is not None and ds.shape[0] != rows):
        want = f"{rows} rows" if rows is not None and ds.ndim == ndim else f"{ndim} dimensions"
        raise BadInputError(f"{path}: dataset {name} has shape {ds.shape}, not {want}; {_FIX}")
    if whole and ds.size and not _written(ds):
        raise BadInputError(
            f"{path}: dataset {name} declares {ds.size} values ({ds.shape}) but the file holds none or only "
            f"some of them (never written, or cut short); {_FIX}"
        )
    return ds


def _written(ds: h5py.Dataset) -> bool:
    """Whether every value of `ds` has storage in the file (an unwritten one reads as the fill value)."""
    if ds.chunks is None:  # contiguous or compact: allocated whole on the first write
        return ds.id.get_storage_size() >= ds.size * ds.dtype.itemsize
    return ds.id.get_num_chunks() >= math.prod(-(-n // c) for n, c in zip(ds.shape, ds.chunks, strict=True))


def _row_written(ds: h5py.Dataset, row: int) -> bool:
    """Whether row `row` of `ds` (its first chunk, when chunked) has storage in the file."""
    if ds.chunks is None:
        return ds.id.get_storage_size() > 0
    return ds.id.get_chunk_info_by_coord((row,) + (0,) * (ds.ndim - 1)).byte_offset is not None


def _check_rows_written(
    num_boxes: h5py.Dataset, per_row: dict[str, h5py.Dataset], ids: h5py.Dataset, path: Path
) -> None:
    """Refuse the file, before any of its values is read, when a row with boxes has a dataset that was
    never written for it: read, it would be zeros, in whatever amount the file declares."""
    # a contiguous dataset is written whole or not at all: one look; a chunked one, one look per row
    whole = [ds for ds in per_row.values() if ds.chunks is None]
    chunked = [ds for ds in per_row.values() if ds.chunks is not None]
    for start in range(0, len(num_boxes), 1 << 16):
        for i in np.flatnonzero(num_boxes[start : start + (1 << 16)]):
            row = start + int(i)
            unwritten = [ds.name.lstrip("/") for ds in (*whole, *chunked) if not _row_written(ds, row)]
            if unwritten:
                raise BadInputError(
                    f"{path} row {row} (id {ids[row]!r}) has {num_boxes[row]} boxes but its "
                    f"{', '.join(unwritten)} were never written (the file declares more than it holds); "
                    f"{_FIX}"
                )
            whole = []  # written, so written whole


def _width(ds: h5py.Dataset, path: Path) -> int:
    """The padded box count of (rows, boxes, ...) dataset `ds`, within what a store holds."""
    if not 0 < ds.shape[1] <= MAX_BOXES:
        raise BadInputError(f"{path}: {ds.name} is {ds.shape[1]} boxes wide, outside 1..{MAX_BOXES}; {_FIX}")
    return int(ds.shape[1])


def _feature_dim(ds: h5py.Dataset, path: Path) -> int:
    if not 0 < ds.shape[-1] <= MAX_FEATURE_DIM:
        raise BadInputError(
            f"{path}: {ds.name} holds {ds.shape[-1]}-d features, outside 1..{MAX_FEATURE_DIM}; {_FIX}"
        )
    return int(ds.shape[-1])


def _block(row_bytes: int) -> int:
    """Rows per read: `_BLOCK`, fewer when rows are wide, so one read stays within `_BLOCK_BYTES`."""
    return max(1, min(_BLOCK, _BLOCK_BYTES // max(row_bytes, 1)))


def _spans(f: h5py.File, path: Path) -> np.ndarray:
    """pos_boxes, the [start, end) rows of each image in the flat datasets, checked against them."""
    pos_ds = _dataset(f, "pos_boxes", path, 2)
    total = len(_dataset(f, "image_features", path, 2))
    if pos_ds.shape[1] != 2 or pos_ds.dtype.kind not in "iu":
        raise BadInputError(f"{path}: pos_boxes is {pos_ds.shape} {pos_ds.dtype}, not (images, 2) integers")
    if pos_ds.shape[0] > total + 1:
        raise BadInputError(f"{path}: pos_boxes lists {pos_ds.shape[0]} images for {total} boxes; {_FIX}")
    pos = pos_ds[:].astype(np.int64)
    bad = (
        (pos[:, 0] < 0) | (pos[:, 0] > pos[:, 1]) | (pos[:, 1] > total) | (pos[:, 1] - pos[:, 0] > MAX_BOXES)
    )
    if bad.any():
        row = int(np.argmax(bad))
        raise BadInputError(
            f"{path}: pos_boxes row {row} spans boxes {pos[row].tolist()}, not within 0..{total} and at "
            f"most {MAX_BOXES} long; {_FIX}"
        )
    return pos


def _read_xmodal(f: h5py.File, path: Path) -> Iterator[tuple[str, RegionFeatures | BadInputError]]:
    total = len(_dataset(f, "img_id", path, 1))
    ids = f["img_id"].asstr()
    for name in ("img_h", "img_w", "num_boxes"):
        _dataset(f, name, path, 1, total)
    # rows of images without boxes are never written by `export_hdf5`: checked row by row below
    per_row = {"boxes": _dataset(f, "image_bb", path, 3, total, whole=False)}
    width = _width(per_row["boxes"], path)
    features = per_row["features"] = _dataset(f, "image_features", path, 3, total, whole=False)
    for name in _LABEL_FIELDS:
        per_row[name] = _dataset(f, name, path, 2, total, whole=False)
    if "class_probs" in f:
        _dataset(f, "has_class_probs", path, 1, total)
        _dataset(f, "class_probs", path, 3, total, whole=False)
    if f["image_bb"].shape[2] != 4 or features.shape[1] != width:
        raise BadInputError(
            f"{path}: image_bb {f['image_bb'].shape} and image_features {features.shape} disagree; {_FIX}"
        )
    step = _block(width * _feature_dim(features, path) * features.dtype.itemsize)
    _check_rows_written(f["num_boxes"], per_row, ids, path)
    for start in range(0, total, step):
        stop = min(start + step, total)
        block = {name: f[name][start:stop] for name in ("img_h", "img_w", "num_boxes", *_LABEL_FIELDS)}
        block["boxes"] = f["image_bb"][start:stop]
        block["features"] = f["image_features"][start:stop]
        if "class_probs" in f:
            block["class_probs"] = f["class_probs"][start:stop]
            block["has_class_probs"] = f["has_class_probs"][start:stop]
        block_ids = ids[start:stop]
        probs, has_probs = block.get("class_probs"), block.get("has_class_probs")
        for i in range(stop - start):
            where = f"{path} row {start + i} (id {block_ids[i]!r})"
            n = int(block["num_boxes"][i])
            if not 0 <= n <= block["boxes"].shape[1]:
                yield where, BadInputError(f"{where}: num_boxes {n} outside 0..{block['boxes'].shape[1]}")
                continue
            yield (
                where,
                RegionFeatures(
                    img_id=str(block_ids[i]),
                    img_h=int(block["img_h"][i]),
                    img_w=int(block["img_w"][i]),
                    boxes=block["boxes"][i, :n],
                    features=block["features"][i, :n],
                    **{name: block[name][i, :n] for name in _LABEL_FIELDS},
                    class_probs=probs[i, :n] if has_probs is not None and has_probs[i] else None,
                ),
            )


def _read_butd(
    f: h5py.File, path: Path, row_ids: dict[int, str], id_map: Path
) -> Iterator[tuple[str, RegionFeatures | BadInputError]]:
    """Rows of image_features (N, boxes, D) or, in the adaptive variant, flat (total, D) with pos_boxes;
    first, what the file and its id map (`id_map`) hold that no record will: ids of rows the file lacks,
    and the detector labels this layout has no datasets for."""
    if "spatial_features" not in f:
        raise BadInputError(f"{path}: no spatial_features dataset: the image sizes cannot be recovered")
    pos = _spans(f, path) if "pos_boxes" in f else None
    ndim = 2 if pos is not None else 3
    feats = _dataset(f, "image_features", path, ndim)
    bb = _dataset(f, "image_bb", path, ndim, len(feats))
    spatial = _dataset(f, "spatial_features", path, ndim, len(feats))
    if bb.shape[-1] != 4 or spatial.shape[-1] != 6 or bb.shape[:-1] != feats.shape[:-1] != spatial.shape[:-1]:
        raise BadInputError(
            f"{path}: image_bb {bb.shape}, spatial_features {spatial.shape} and image_features {feats.shape} "
            f"disagree; {_FIX}"
        )
    width = MAX_BOXES if pos is not None else _width(feats, path)
    step = _block(width * _feature_dim(feats, path) * feats.dtype.itemsize)
    rows = len(pos) if pos is not None else len(feats)
    beyond = sorted((row, img_id) for row, img_id in row_ids.items() if not 0 <= row < rows)
    if beyond:
        shown = ", ".join(f"{img_id!r} (row {row})" for row, img_id in beyond[:3])
        more = f" and {len(beyond) - 3} more" if len(beyond) > 3 else ""
        yield (
            str(id_map),
            DroppedInput(
                f"{id_map} names {len(beyond)} ids for rows {path} does not have (it has {rows}): "
                f"{shown}{more}; they are not imported",
                len(beyond),
                "ids without rows",
            ),
        )
    missing = [name for name in _LABEL_FIELDS if name not in f]
    why = f"has no {', '.join(missing)} datasets" if missing else "holds labels this layout does not read"
    yield (
        str(path),
        DroppedInput(
            f"{path} {why}: its records are stored without detector labels (unknown, at confidence 0)"
        ),
    )
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        if pos is None:
            rows_of = list(zip(bb[start:stop], feats[start:stop], spatial[start:stop], strict=True))
        else:
            rows_of = [(bb[a:b], feats[a:b], spatial[a:b]) for a, b in pos[start:stop]]
        for i, (boxes, features, sp) in enumerate(rows_of):
            row = start + i
            img_id = row_ids.get(row)
            where = f"{path} row {row} (id {img_id!r})"
            if img_id is None:
                yield where, BadInputError(f"{where}: the id map names no image for this row")
                continue
            size = _image_size(boxes, sp)
            if size is None:
                yield where, BadInputError(f"{where}: spatial_features give no box to recover the image size")
                continue
            n = len(boxes)
            yield (
                where,
                RegionFeatures(
                    img_id=img_id,
                    img_h=size[0],
                    img_w=size[1],
                    boxes=boxes,
                    features=features,
                    # no detector labels in this layout: unknown, at confidence 0
                    objects_id=np.full(n, UNKNOWN_LABEL, np.int64),
                    objects_conf=np.zeros(n, np.float32),
                    attrs_id=np.full(n, UNKNOWN_LABEL, np.int64),
                    attrs_conf=np.zeros(n, np.float32),
                ),
            )


def _image_size(boxes: np.ndarray, spatial: np.ndarray) -> tuple[int, int] | None:
    """(h, w) from the spatial features (x1/W, y1/H, x2/W, y2/H, w/W, h/H) of the widest/tallest box."""
    widths, heights = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    iw, ih = int(np.argmax(widths)) if len(boxes) else 0, int(np.argmax(heights)) if len(boxes) else 0
    if not len(boxes) or spatial[iw, 4] <= 0 or spatial[ih, 5] <= 0:
        return None
    return int(round(heights[ih] / spatial[ih, 5])), int(round(widths[iw] / spatial[iw, 4]))


def _row_ids(path: Path, ids: str | os.PathLike | None, f: h5py.File) -> tuple[dict[int, str], Path]:
    """Row -> image id from a JSON {id: row} or [id, ...], or a text file with one id per line."""
    if ids is None:
        stem = path.with_suffix("")
        candidates = [Path(f"{stem}_imgid2idx.json"), Path(f"{stem}_ids.json"), Path(f"{stem}_ids.txt")]
        ids = next((c for c in candidates if c.is_file()), None)
        if ids is None:
            pickle = Path(f"{stem}_imgid2idx.pkl")
            hint = (
                f"{pickle} is a pickle, which xmodal never loads (it can run code); write its "
                f"{{image id: row}} map as JSON to {stem}_imgid2idx.json, or its ids in row order, one per "
                f"line, to {stem}_ids.txt"
                if pickle.is_file()
                else f"give it with --ids, or put it at {candidates[0]}"
            )
            raise BadInputError(f"{path}: no id -> row map for this bottom-up-attention-vqa file; {hint}")
    ids = Path(ids)
    if not ids.is_file():
        raise BadInputError(f"{ids}: no such id map file (--ids)")
    with open(ids, "rb") as fh:
        pickled = fh.read(1) == b"\x80"  # every pickle since protocol 2 starts so; no text file does
    if pickled or ids.suffix in (".pkl", ".pickle"):
        raise BadInputError(
            f"{ids} is a pickle, which xmodal never loads (it can run code); write its {{image id: row}} map "
            f"as JSON (json.dump(dict(pickle.load(f)), ...)) or its ids in row order, one per line, and pass "
            "that with --ids"
        )
    try:
        return _read_row_ids(ids), ids
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInputError(
            f"{ids}: not a JSON {{id: row}} map, a JSON list or a text file of ids ({exc})"
        ) from None


def _read_row_ids(ids: Path) -> dict[int, str]:
    if ids.suffix == ".json":
        with open(ids, encoding="utf-8") as fh:
            data = json.load(fh)
        if isinstance(data, dict):
            mapping = {int(row): str(img_id) for img_id, row in data.items()}
        elif isinstance(data, list):
            mapping = {row: str(img_id) for row, img_id in enumerate(data)}
        else:
            raise BadInputError(f"{ids}: expected a JSON object {{id: row}} or a list of ids")
    else:
        with open(ids, encoding="utf-8") as fh:
            mapping = {row: line.strip() for row, line in enumerate(fh) if line.strip()}
    if len(set(mapping.values())) != len(mapping):
        raise BadInputError(f"{ids}: the id map names some image twice")
    return mapping


def export_hdf5(src: FeatureReader, dst: str | os.PathLike, dtype: str = "float32") -> int:
    """Padded (N, max_boxes, ...) datasets under the bottom-up-attention-vqa names plus every record field,
    and the id -> row map as `<stem>_imgid2idx.json` beside it; both written to temporary names and
    renamed at the end."""
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".partial")
    ids = list(src.keys())
    n, m, d = len(ids), src.max_boxes, src.feature_dim
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = H5_FORMAT
            f.attrs["format_version"] = H5_FORMAT_VERSION
            f.attrs["meta"] = json.dumps(src.meta, sort_keys=True)
            f.create_dataset("img_id", data=np.array(ids, dtype=object), dtype=h5py.string_dtype())
            out = {
                "img_h": f.create_dataset("img_h", (n,), "i4"),
                "img_w": f.create_dataset("img_w", (n,), "i4"),
                "num_boxes": f.create_dataset("num_boxes", (n,), "i4"),
                "image_bb": f.create_dataset("image_bb", (n, m, 4), "f4"),
                "spatial_features": f.create_dataset("spatial_features", (n, m, 6), "f4"),
                "image_features": f.create_dataset(
                    "image_features", (n, m, d), dtype, chunks=(1, m, d) if n else None
                ),
                "objects_id": f.create_dataset("objects_id", (n, m), "i8"),
                "objects_conf": f.create_dataset("objects_conf", (n, m), "f4"),
                "attrs_id": f.create_dataset("attrs_id", (n, m), "i8"),
                "attrs_conf": f.create_dataset("attrs_conf", (n, m), "f4"),
            }
            for row, img_id in enumerate(ids):
                rec = src[img_id]
                k = rec.num_boxes
                out["img_h"][row], out["img_w"][row], out["num_boxes"][row] = rec.img_h, rec.img_w, k
                if rec.class_probs is not None:
                    if "class_probs" not in out:
                        # created at the first record that has them: (n, M, C) float16 and a per-row flag
                        c = rec.class_probs.shape[1]
                        out["class_probs"] = f.create_dataset(
                            "class_probs", (n, m, c), CLASS_PROBS_DTYPE, chunks=(1, m, c)
                        )
                        out["has_class_probs"] = f.create_dataset("has_class_probs", (n,), "u1")
                    if rec.class_probs.shape[1] != out["class_probs"].shape[2]:
                        raise ValueError(
                            f"record {img_id!r}: class_probs over {rec.class_probs.shape[1]} classes but "
                            f"earlier records have {out['class_probs'].shape[2]}: one HDF5 file holds one "
                            "class count"
                        )
                    out["has_class_probs"][row] = 1
                    out["class_probs"][row, :k] = rec.class_probs
                if not k:
                    continue
                out["image_bb"][row, :k] = rec.boxes
                out["spatial_features"][row, :k] = _spatial(rec)
                out["image_features"][row, :k] = rec.features
                for name in _LABEL_FIELDS:
                    out[name][row, :k] = getattr(rec, name)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a damaged record, an interrupt: no half-written file is left
        raise
    id_map = Path(f"{dst.with_suffix('')}_imgid2idx.json")
    id_map_tmp = id_map.with_name(id_map.name + ".partial")
    id_map_tmp.write_text(
        json.dumps({img_id: row for row, img_id in enumerate(ids)}) + "\n", encoding="utf-8"
    )
    os.replace(tmp, dst)
    os.replace(id_map_tmp, id_map)
    return n


def _spatial(rec: RegionFeatures) -> np.ndarray:
    """bottom-up-attention-vqa's spatial features: x1/W, y1/H, x2/W, y2/H, w/W, h/H."""
    b = rec.boxes.astype(np.float32)
    scale = np.array([rec.img_w, rec.img_h, rec.img_w, rec.img_h], np.float32)
    norm = b / scale
    return np.concatenate([norm, norm[:, 2:3] - norm[:, 0:1], norm[:, 3:4] - norm[:, 1:2]], axis=1)
