"""HDF5: the bottom-up-attention-vqa layout with its id map forms, and xmodal's own export layout."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

from pipelines.cli import main
from storage import BadInputError, FeatureReader, FeatureWriter
from storage.hdf5 import read_hdf5
from storage.importer import import_records
from storage.records import UNKNOWN_LABEL


def write_butd(path, recs, adaptive=False):
    """As bottom-up-attention-vqa's tools/detection_features_converter.py lays it out."""
    bb = np.concatenate([r.boxes for r in recs]) if adaptive else np.stack([r.boxes for r in recs])
    feats = np.concatenate([r.features for r in recs]) if adaptive else np.stack([r.features for r in recs])
    spatial = []
    for r in recs:
        w, h = float(r.img_w), float(r.img_h)
        bw, bh = r.boxes[:, 2] - r.boxes[:, 0], r.boxes[:, 3] - r.boxes[:, 1]
        sx, sy = r.boxes[:, 0] / w, r.boxes[:, 1] / h
        spatial.append(np.stack([sx, sy, sx + bw / w, sy + bh / h, bw / w, bh / h], 1))
    with h5py.File(path, "w") as f:
        f.create_dataset("image_features", data=feats, dtype="f")
        f.create_dataset("image_bb", data=bb, dtype="f")
        f.create_dataset(
            "spatial_features", data=np.concatenate(spatial) if adaptive else np.stack(spatial), dtype="f"
        )
        if adaptive:
            ends = np.cumsum([r.num_boxes for r in recs])
            f.create_dataset("pos_boxes", data=np.stack([ends - [r.num_boxes for r in recs], ends], 1))


def check_butd_import(dst, recs, same):
    r = FeatureReader(dst)
    assert len(r) == len(recs)
    for rec in recs:
        got = r[rec.img_id]
        assert (got.img_h, got.img_w) == (rec.img_h, rec.img_w)
        np.testing.assert_array_equal(got.boxes, rec.boxes)
        np.testing.assert_array_equal(got.features, rec.features.astype(np.float16))
        assert not got.objects_conf.any() and not got.attrs_conf.any()
        assert got.objects_id.shape == (rec.num_boxes,)
        assert (got.objects_id == UNKNOWN_LABEL).all() and (got.attrs_id == UNKNOWN_LABEL).all()


@pytest.mark.parametrize("form", ["imgid2idx_json", "ids_txt", "ids_json_list", "explicit"])
def test_butd_layout_with_each_id_map_form(tmp_path, make_record, same, form):
    recs = [make_record(i, img_id=str(100 + i)) for i in range(5)]
    rows = [3, 0, 4, 1, 2]  # row of recs[i]
    write_butd(tmp_path / "train36.hdf5", [recs[rows.index(k)] for k in range(5)])
    by_row = [recs[rows.index(k)].img_id for k in range(5)]
    ids = None
    if form == "imgid2idx_json":
        (tmp_path / "train36_imgid2idx.json").write_text(
            json.dumps({r.img_id: rows[i] for i, r in enumerate(recs)})
        )
    elif form == "ids_txt":
        (tmp_path / "train36_ids.txt").write_text("\n".join(by_row) + "\n")
    elif form == "ids_json_list":
        (tmp_path / "train36_ids.json").write_text(json.dumps(by_row))
    else:
        ids = tmp_path / "elsewhere.txt"
        ids.write_text("\n".join(by_row))
    report = import_records(read_hdf5(tmp_path / "train36.hdf5", ids=ids), "train36.hdf5", tmp_path / "s")
    assert report.written == 5
    check_butd_import(tmp_path / "s", recs, same)


def test_butd_adaptive_layout_with_pos_boxes(tmp_path, make_record, same):
    recs = [make_record(i, num_boxes=n) for i, n in enumerate([10, 36, 17])]
    write_butd(tmp_path / "val.h5", recs, adaptive=True)
    (tmp_path / "val_ids.txt").write_text("\n".join(r.img_id for r in recs))
    assert main(["features", "import", str(tmp_path / "val.h5"), str(tmp_path / "s")]) == 0
    check_butd_import(tmp_path / "s", recs, same)
    assert FeatureReader(tmp_path / "s").max_boxes == 36  # the longest pos_boxes span


def test_a_pickled_id_map_is_never_loaded(tmp_path, make_record):
    write_butd(tmp_path / "train36.hdf5", [make_record(0)])
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (tmp_path / "train36_imgid2idx.pkl").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(BadInputError, match="pickle, which xmodal never loads.*imgid2idx.json"):
        list(read_hdf5(tmp_path / "train36.hdf5"))
    assert not marker.exists()
    # given explicitly with --ids, under any name, it is named as a pickle too and still never loaded
    for name in ("train36_imgid2idx.pkl", "ids.json"):
        (tmp_path / name).write_bytes(pickle.dumps(Payload()))
        with pytest.raises(BadInputError, match=f"{name} is a pickle, which xmodal never loads.*as JSON"):
            list(read_hdf5(tmp_path / "train36.hdf5", ids=tmp_path / name))
    assert not marker.exists()
    (tmp_path / "bytes.txt").write_bytes(b"img\xff\xfe")
    with pytest.raises(BadInputError, match="bytes.txt: not a JSON .* or a text file of ids"):
        list(read_hdf5(tmp_path / "train36.hdf5", ids=tmp_path / "bytes.txt"))


def test_own_export_round_trips_and_reads_as_butd(tmp_path, make_record, same, caplog):
    recs = [make_record(i, num_boxes=n) for i, n in enumerate([36, 3, 0, 50])]
    with FeatureWriter(tmp_path / "s", feature_dim=64, max_boxes=50, meta={"detector": "x"}) as w:
        for rec in recs:
            w.put(rec)
    assert main(["features", "export", str(tmp_path / "s"), str(tmp_path / "out.h5")]) == 0
    with h5py.File(tmp_path / "out.h5") as f:
        assert f["image_features"].shape == (4, 50, 64) and f["image_features"].dtype == np.float32
        row = list(f["img_id"].asstr()[:]).index("img_000001")
        np.testing.assert_array_equal(f["image_bb"][row, :3], recs[1].boxes)
        assert not f["image_features"][row, 3:].any()
        np.testing.assert_allclose(
            f["spatial_features"][row, :3, 4],
            (recs[1].boxes[:, 2] - recs[1].boxes[:, 0]) / recs[1].img_w,
            rtol=1e-6,
        )
        assert json.loads(f.attrs["meta"])["provenance"] == {"detector": "x"}
    assert main(["features", "import", str(tmp_path / "out.h5"), str(tmp_path / "back")]) == 0
    r = FeatureReader(tmp_path / "back")
    assert len(r) == 4 and r.max_boxes == 50
    for rec in recs:
        same(r[rec.img_id], rec)
    (tmp_path / "ids.txt").write_text("a\nb\nc\nd\n")
    with caplog.at_level("WARNING", logger="storage.hdf5"):  # the file's own ids win, and that is said
        ids = [img_id for img_id, _ in read_hdf5(tmp_path / "out.h5", ids=tmp_path / "ids.txt")]
    assert "--ids" in caplog.text and "ignored" in caplog.text and "a" not in ids


def test_unknown_hdf5_layout_is_named(tmp_path):
    with h5py.File(tmp_path / "x.h5", "w") as f:
        f["something"] = np.zeros(3)
    with pytest.raises(BadInputError, match="something"):
        list(read_hdf5(tmp_path / "x.h5"))


# The id map conversion the manual (docs/store.md) gives bottom-up-attention-vqa users (run on their
# side): xmodal's JSON
# {id: row} -> their {int image id: row} pickle, protocol 2 for their Python 2 cPickle.
TO_PICKLE = (
    "import json, pickle; m = json.load(open('{src}')); "
    "pickle.dump({{int(k.rsplit('_', 1)[-1]): v for k, v in m.items()}}, open('{dst}', 'wb'), protocol=2)"
)


def test_export_is_read_by_the_bottom_up_attention_vqa_loader(tmp_path, make_record):
    coco = [42, 9, 139]
    recs = [make_record(i, img_id=f"COCO_val2014_{c:012d}", feature_dim=32) for i, c in enumerate(coco)]
    with FeatureWriter(tmp_path / "s", feature_dim=32) as w:
        for rec in recs:
            w.put(rec)
    data = tmp_path / "data"
    data.mkdir()
    assert main(["features", "export", str(tmp_path / "s"), str(data / "val36.hdf5")]) == 0
    id_map = json.loads((data / "val36_imgid2idx.json").read_text())
    assert sorted(id_map) == sorted(r.img_id for r in recs)
    src, dst = data / "val36_imgid2idx.json", data / "val36_imgid2idx.pkl"
    subprocess.run([sys.executable, "-c", TO_PICKLE.format(src=src, dst=dst)], check=True)

    # bottom-up-attention-vqa's dataset.py, restated: the pickle this test just wrote, then whole arrays
    img_id2idx = pickle.loads(dst.read_bytes())
    with h5py.File(data / "val36.hdf5", "r") as hf:
        features = np.array(hf.get("image_features"))
        spatials = np.array(hf.get("spatial_features"))
    assert features.dtype == np.float32 and spatials.dtype == np.float32
    assert features.shape == (3, 36, 32) and spatials.shape == (3, 36, 6)
    for c, rec in zip(coco, recs, strict=True):
        row = img_id2idx[c]
        np.testing.assert_array_equal(features[row], rec.features.astype(np.float16).astype(np.float32))
        np.testing.assert_allclose(spatials[row, :, 0], rec.boxes[:, 0] / rec.img_w, rtol=1e-6)


def test_butd_import_keeps_the_ids_of_the_users_map(tmp_path, make_record, same):
    ids = ["COCO_train2014_000000000009", "COCO_train2014_000000000025"]
    recs = [make_record(i, img_id=img_id) for i, img_id in enumerate(ids)]
    write_butd(tmp_path / "train36.hdf5", recs[::-1])  # rows in the other order
    (tmp_path / "map.json").write_text(json.dumps({ids[0]: 1, ids[1]: 0}))
    args = ["features", "import", str(tmp_path / "train36.hdf5"), str(tmp_path / "s"), "--ids"]
    assert main([*args, str(tmp_path / "map.json")]) == 0
    r = FeatureReader(tmp_path / "s")
    assert sorted(r.keys()) == ids  # not "0", "1"
    check_butd_import(tmp_path / "s", recs, same)
    assert r.meta["provenance"]["imported_from"]["labels"] == "absent"


def test_class_probs_survive_the_own_hdf5_round_trip(tmp_path, make_record, same):
    recs = [make_record(i, num_boxes=n, feature_dim=8) for i, n in enumerate([4, 0, 6])]
    recs[0].class_probs = np.full((4, 5), 0.2, np.float32)
    recs[1].class_probs = np.zeros((0, 5), np.float32)
    with FeatureWriter(tmp_path / "s", feature_dim=8) as w:
        for rec in recs:
            w.put(rec)
    assert main(["features", "export", str(tmp_path / "s"), str(tmp_path / "out.h5")]) == 0
    assert main(["features", "import", str(tmp_path / "out.h5"), str(tmp_path / "back")]) == 0
    r = FeatureReader(tmp_path / "back")
    for rec in recs:
        got = r[rec.img_id]
        same(got, rec)
        if rec.class_probs is None:
            assert got.class_probs is None
        else:
            np.testing.assert_array_equal(got.class_probs, rec.class_probs.astype(np.float16))


def test_importing_an_own_export_keeps_what_produced_the_features(tmp_path, make_record):
    detector = {"detector": "vg-faster-rcnn", "preset": "c4-small", "config": {"min_size": 96}}
    with FeatureWriter(tmp_path / "s", feature_dim=64, max_boxes=40, meta=detector) as w:
        w.put(make_record(0, num_boxes=5))
    assert main(["features", "export", str(tmp_path / "s"), str(tmp_path / "out.h5")]) == 0
    assert main(["features", "import", str(tmp_path / "out.h5"), str(tmp_path / "back")]) == 0
    back = FeatureReader(tmp_path / "back")
    provenance = back.meta["provenance"]
    assert {k: provenance[k] for k in detector} == detector  # ask and serve rebuild this detector
    assert provenance["imported_from"]["format"] == "hdf5" and back.max_boxes == 40
    # a foreign layout says nothing about its detector: nothing is made up
    write_butd(tmp_path / "butd.h5", [make_record(1, num_boxes=3)])
    (tmp_path / "ids.txt").write_text("img_000001\n")
    argv = ["features", "import", str(tmp_path / "butd.h5"), str(tmp_path / "butd"), "--ids"]
    assert main([*argv, str(tmp_path / "ids.txt")]) == 0
    assert set(FeatureReader(tmp_path / "butd").meta["provenance"]) <= {"imported_from", "unlabelled_records"}


def _export(tmp_path, make_record, name="ok.h5"):
    with FeatureWriter(tmp_path / "s", feature_dim=32) as w:
        for i in range(4):
            w.put(make_record(i, feature_dim=32))
    main(["features", "export", str(tmp_path / "s"), str(tmp_path / name)])
    return tmp_path / name


def _declared(path, write_sizes=True):
    """An xmodal-layout file whose 32 records declare 4 GiB of features that were never written."""
    with h5py.File(path, "w") as f:
        f.attrs["format"] = "xmodal-region-features-h5"
        f.create_dataset(
            "img_id", data=np.array([f"i{i}" for i in range(32)], dtype=object), dtype=h5py.string_dtype()
        )
        for name in ("img_h", "img_w", "num_boxes"):
            ds = f.create_dataset(name, (32,), "i4")
            if write_sizes:
                ds[:] = 36 if name == "num_boxes" else 100
        f.create_dataset("image_bb", (32, 4096, 4), "f4")
        f.create_dataset("image_features", (32, 4096, 8192), "f4", chunks=(1, 64, 8192))
        for name in ("objects_id", "attrs_id"):
            f.create_dataset(name, (32, 4096), "i8")
        for name in ("objects_conf", "attrs_conf"):
            f.create_dataset(name, (32, 4096), "f4")
    return path


def _truncated(tmp_path, make_record):
    path = _export(tmp_path, make_record)
    os.truncate(path, path.stat().st_size // 2)
    return path


def _text(tmp_path, make_record):
    (tmp_path / "t.h5").write_text("img_id\tnum_boxes\nnot hdf5 at all\n")
    return tmp_path / "t.h5"


def _missing(tmp_path, make_record):
    path = _export(tmp_path, make_record)
    with h5py.File(path, "a") as f:
        del f["num_boxes"]
    return path


def _butd_declared(tmp_path, make_record):
    with h5py.File(tmp_path / "b.h5", "w") as f:
        for name, width in (("image_features", 2048), ("image_bb", 4), ("spatial_features", 6)):
            f.create_dataset(name, (32, 36, width), "f4")
    (tmp_path / "b_ids.txt").write_text("".join(f"i{i}\n" for i in range(32)))
    return tmp_path / "b.h5"


def _pos_boxes_past_the_end(tmp_path, make_record):
    recs = [make_record(i, feature_dim=32) for i in range(3)]
    write_butd(tmp_path / "p.h5", recs, adaptive=True)
    with h5py.File(tmp_path / "p.h5", "a") as f:
        f["pos_boxes"][1] = [0, 10**9]
    (tmp_path / "p_ids.txt").write_text("a\nb\nc\n")
    return tmp_path / "p.h5"


@pytest.mark.parametrize(
    "make, needle",
    [
        (_truncated, "not a readable HDF5 file"),
        (_text, "not a readable HDF5 file"),
        (_missing, "no num_boxes dataset"),
        (lambda tmp_path, mk: _declared(tmp_path / "d.h5", write_sizes=False), "dataset img_h declares 32"),
        (lambda tmp_path, mk: _declared(tmp_path / "d.h5"), "has 36 boxes but its image_bb"),
        (_butd_declared, "declares 2359296 values"),
        (_pos_boxes_past_the_end, "pos_boxes row 1 spans"),
    ],
)
def test_hdf5_files_whose_headers_lie_are_one_line(make, needle, tmp_path, make_record, capsys, caplog):
    """Issue 46: truncated, not HDF5, a dataset missing, declared but never written: refused, no record
    written (never zeros), no traceback."""
    src = make(tmp_path, make_record)
    with pytest.raises(BadInputError, match=needle):
        import_records(read_hdf5(src), src, tmp_path / "dst")
    assert main(["features", "import", str(src), str(tmp_path / "dst2")]) == 1
    assert not (tmp_path / "dst2" / "data.mdb").exists()
    assert needle in caplog.text and "Traceback" not in capsys.readouterr().err


def test_hdf5_declaring_gigabytes_is_refused_in_bounded_memory(tmp_path):
    """A 10 KB file declaring 4 GiB of features: refused before any of it is read (peak RSS < 300 MB,
    the child capped at 2 GiB of address space so a regression fails instead of swapping)."""
    src = _declared(tmp_path / "d.h5")
    assert src.stat().st_size < 64 << 10
    script = f"""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
        from storage.hdf5 import read_hdf5
        from storage.errors import BadInputError
        try:
            print(sum(1 for _, rec in read_hdf5({str(src)!r}) if not isinstance(rec, BadInputError)))
        except BadInputError as exc:
            print(0)
        print(int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) >> 10)
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    written, peak_mb = proc.stdout.split()
    assert written == "0" and int(peak_mb) < 300, proc.stdout


def test_an_import_says_what_the_file_holds_that_no_record_carries(
    tmp_path, make_record, same, capsys, caplog
):
    """An id map naming 345 ids for a file of 300 rows, and a layout without label datasets: the summary line
    counts the ids without rows and the records stored without labels; --strict refuses before writing."""
    recs = [make_record(i, num_boxes=2, feature_dim=8) for i in range(300)]
    write_butd(tmp_path / "t.h5", recs)
    names = [r.img_id for r in recs] + [f"ghost_{i}" for i in range(45)]
    (tmp_path / "t_ids.txt").write_text("\n".join(names) + "\n")
    argv = ["features", "import", str(tmp_path / "t.h5"), str(tmp_path / "s")]
    assert main(argv) == 0
    line = capsys.readouterr().out.strip()
    assert line.endswith(
        "300 records written, 0 already present, 0 bad skipped, 45 ids without rows, "
        "300 written without detector labels (stored as unknown)"
    )
    assert "names 45 ids for rows" in caplog.text and "'ghost_0' (row 300)" in caplog.text
    assert "has no objects_id, objects_conf, attrs_id, attrs_conf datasets" in caplog.text
    check_butd_import(tmp_path / "s", recs, same)
    assert main([*argv[:3], str(tmp_path / "strict"), "--strict"]) == 1
    assert "refused (--strict)" in caplog.records[-1].getMessage() and not (tmp_path / "strict").exists()
