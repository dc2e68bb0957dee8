"""Feature TSVs (LXMERT's and bottom-up-attention's): exports read by the original loader's logic, imports
stream with precise errors."""

from __future__ import annotations

import base64
import csv
import sys

import numpy as np
import pytest

from pipelines.cli import main
from storage import BadInputError, FeatureReader, FeatureWriter
from storage.importer import import_records
from storage.records import UNKNOWN_LABEL
from storage.tsv import export_tsv, read_tsv

# The original LXMERT loader (src/utils.py load_obj_tsv), restated for the test.
FIELDNAMES = [
    "img_id",
    "img_h",
    "img_w",
    "objects_id",
    "objects_conf",
    "attrs_id",
    "attrs_conf",
    "num_boxes",
    "boxes",
    "features",
]


def lxmert_load_obj_tsv(fname):
    csv.field_size_limit(sys.maxsize)
    data = []
    with open(fname) as f:
        for item in csv.DictReader(f, FIELDNAMES, delimiter="\t"):
            for key in ["img_h", "img_w", "num_boxes"]:
                item[key] = int(item[key])
            boxes = item["num_boxes"]
            decode_config = [
                ("objects_id", (boxes,), np.int64),
                ("objects_conf", (boxes,), np.float32),
                ("attrs_id", (boxes,), np.int64),
                ("attrs_conf", (boxes,), np.float32),
                ("boxes", (boxes, 4), np.float32),
                ("features", (boxes, -1), np.float32),
            ]
            for key, shape, dtype in decode_config:
                item[key] = np.frombuffer(base64.b64decode(item[key]), dtype=dtype).reshape(shape)
            data.append(item)
    return data


def tsv_line(rec, **override) -> str:
    """An independent writer of one LXMERT TSV line; `override` replaces raw field strings."""

    def b64(a, dt):
        return base64.b64encode(np.asarray(a, dt).tobytes()).decode()

    fields = {
        "img_id": rec.img_id,
        "img_h": str(rec.img_h),
        "img_w": str(rec.img_w),
        "objects_id": b64(rec.objects_id, "<i8"),
        "objects_conf": b64(rec.objects_conf, "<f4"),
        "attrs_id": b64(rec.attrs_id, "<i8"),
        "attrs_conf": b64(rec.attrs_conf, "<f4"),
        "num_boxes": str(rec.num_boxes),
        "boxes": b64(rec.boxes, "<f4"),
        "features": b64(rec.features, "<f4"),
    }
    fields.update(override)
    return "\t".join(fields[k] for k in FIELDNAMES) + "\n"


def test_export_is_read_by_the_lxmert_loader(tmp_path, make_record):
    recs = [make_record(i, num_boxes=36 if i % 2 else 10) for i in range(6)]
    with FeatureWriter(tmp_path / "s", feature_dim=64) as w:
        for rec in recs:
            w.put(rec)
    assert export_tsv(FeatureReader(tmp_path / "s"), tmp_path / "out.tsv") == 6
    loaded = lxmert_load_obj_tsv(tmp_path / "out.tsv")
    assert [item["img_id"] for item in loaded] == [r.img_id for r in recs]
    for item, rec in zip(loaded, recs, strict=True):
        assert (item["img_h"], item["img_w"], item["num_boxes"]) == (rec.img_h, rec.img_w, rec.num_boxes)
        for key in ("objects_id", "objects_conf", "attrs_id", "attrs_conf", "boxes", "features"):
            np.testing.assert_array_equal(item[key], getattr(rec, key), err_msg=key)
        assert item["features"].dtype == np.float32
    assert not (tmp_path / "out.tsv.partial").exists()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_import_of_a_handwritten_tsv_then_export_round_trips(tmp_path, make_record, same, dtype):
    recs = [make_record(i, num_boxes=n) for i, n in enumerate([36, 1, 0, 20])]
    (tmp_path / "in.tsv").write_text("".join(tsv_line(r) for r in recs) + "\n")
    report = import_records(read_tsv(tmp_path / "in.tsv"), tmp_path / "in.tsv", tmp_path / "s", dtype=dtype)
    assert (report.written, report.bad) == (4, [])
    r = FeatureReader(tmp_path / "s")
    for rec in recs:
        same(r[rec.img_id], rec)
    assert r.meta["provenance"]["imported_from"]["written"] == 4
    assert export_tsv(r, tmp_path / "out.tsv", skip_empty=True) == 3  # the zero-box record left out
    assert sorted((tmp_path / "out.tsv").read_text().splitlines()) == sorted(
        tsv_line(x).rstrip("\n") for x in recs if x.num_boxes
    )


def _bad_lines(rec, feats_b64, make_record):
    return {
        "truncated": tsv_line(rec).rstrip("\n")[: -len(feats_b64) // 2] + "\n",
        "fields": "\t".join(tsv_line(rec).split("\t")[:7]) + "\n",
        "base64_length": tsv_line(rec, objects_conf=base64.b64encode(bytes(8)).decode()),
        "base64_chars": tsv_line(rec, attrs_id="@@@@"),
        "not_int": tsv_line(rec, img_h="tall"),
        "too_many_boxes": tsv_line(make_record(7, num_boxes=40, img_id=rec.img_id)),
    }


@pytest.mark.parametrize(
    "kind,match",
    [
        ("truncated", "base64|bytes"),
        ("fields", "expected 10 tab-separated fields, got 7"),
        ("base64_length", "objects_conf: base64 decodes to 8 bytes, expected 144"),
        ("base64_chars", "attrs_id is not valid base64"),
        ("not_int", "img_h"),
        ("too_many_boxes", "40 boxes exceed"),
        ("duplicate", "duplicate id 'img_000001', first seen at .* line 2"),
    ],
)
def test_malformed_lines_name_the_line_and_id_and_stop_cleanly(tmp_path, make_record, same, kind, match):
    good = [make_record(i) for i in range(4)]
    bad_rec = make_record(1) if kind == "duplicate" else make_record(9)
    bad = (
        tsv_line(bad_rec)
        if kind == "duplicate"
        else _bad_lines(bad_rec, tsv_line(bad_rec).split("\t")[-1], make_record)[kind]
    )
    (tmp_path / "in.tsv").write_text(
        "".join(tsv_line(r) for r in good[:2]) + bad + tsv_line(good[2]) + tsv_line(good[3])
    )
    with pytest.raises(
        BadInputError, match=rf"in\.tsv line 3 \(id '{bad_rec.img_id}'\).*{match}.*--skip-bad"
    ):
        import_records(read_tsv(tmp_path / "in.tsv"), tmp_path / "in.tsv", tmp_path / "s")
    r = FeatureReader(tmp_path / "s")
    assert list(r.keys()) == [good[0].img_id, good[1].img_id]
    same(r[good[1].img_id], good[1])

    report = import_records(read_tsv(tmp_path / "in.tsv"), tmp_path / "in.tsv", tmp_path / "s", skip_bad=True)
    assert (report.written, report.already_present, len(report.bad)) == (2, 2, 1)
    assert "line 3" in report.bad[0]
    r = FeatureReader(tmp_path / "s")
    assert list(r.keys()) == [g.img_id for g in good]
    for g in good:
        same(r[g.img_id], g)
    assert r.meta["provenance"]["imported_from"]["bad"] == report.bad


def test_cli_import_reports_the_bad_line_and_exits_1(tmp_path, make_record, caplog):
    rec = make_record(0)
    (tmp_path / "in.tsv").write_text(tsv_line(rec) + tsv_line(make_record(1), num_boxes="35"))
    assert main(["features", "import", str(tmp_path / "in.tsv"), str(tmp_path / "s")]) == 1
    assert "line 2 (id 'img_000001')" in caplog.text
    assert main(["features", "import", "--skip-bad", str(tmp_path / "in.tsv"), str(tmp_path / "s2")]) == 0
    assert list(FeatureReader(tmp_path / "s2").keys()) == ["img_000000"]


def test_ids_that_cannot_go_in_a_tsv_are_refused(tmp_path, make_record):
    with FeatureWriter(tmp_path / "s", feature_dim=64) as w:
        w.put(make_record(0, img_id="tab\there"))
    with pytest.raises(ValueError, match="tab"):
        export_tsv(FeatureReader(tmp_path / "s"), tmp_path / "out.tsv")
    assert not (tmp_path / "out.tsv").exists() and not (tmp_path / "out.tsv.partial").exists()


def test_cli_import_into_an_existing_store_takes_its_shapes(tmp_path, make_record, same):
    with FeatureWriter(tmp_path / "s", feature_dim=64, max_boxes=50, dtype="float32") as w:
        w.put(make_record(0))
    rec = make_record(1, num_boxes=45)
    rec.features += np.float32(1e-3)  # not representable in float16
    (tmp_path / "in.tsv").write_text(tsv_line(make_record(0)) + tsv_line(rec))
    assert main(["features", "import", str(tmp_path / "in.tsv"), str(tmp_path / "s")]) == 0
    r = FeatureReader(tmp_path / "s")
    assert len(r) == 2 and r.dtype == "float32"
    same(r[rec.img_id], rec)


@pytest.mark.parametrize("boxes", [[0, 0, 36, 0, 5], [0, 0]], ids=["empty_first", "all_empty"])
def test_feature_width_comes_from_the_first_record_with_boxes(tmp_path, make_record, same, boxes):
    recs = [make_record(i, num_boxes=n, feature_dim=64) for i, n in enumerate(boxes)]
    (tmp_path / "in.tsv").write_text("".join(tsv_line(rec) for rec in recs))
    report = import_records(read_tsv(tmp_path / "in.tsv"), tmp_path / "in.tsv", tmp_path / "s")
    assert (report.written, report.bad) == (len(recs), [])
    r = FeatureReader(tmp_path / "s")
    assert r.feature_dim == (64 if any(boxes) else 2048)
    assert list(r.keys()) == [rec.img_id for rec in recs]
    for rec in recs:
        got = r[rec.img_id]
        assert got.features.shape == (rec.num_boxes, r.feature_dim)
        if rec.num_boxes:
            same(got, rec, np.float16)


def test_held_back_empty_records_stay_in_order_with_duplicates_and_bad_lines(tmp_path, make_record):
    empty, full = make_record(0, num_boxes=0, feature_dim=64), make_record(1, feature_dim=64)
    lines = [tsv_line(empty), tsv_line(empty), tsv_line(make_record(2), num_boxes="x"), tsv_line(full)]
    (tmp_path / "in.tsv").write_text("".join(lines))
    report = import_records(read_tsv(tmp_path / "in.tsv"), tmp_path / "in.tsv", tmp_path / "s", skip_bad=True)
    assert report.written == 2 and len(report.bad) == 2
    assert any("duplicate id 'img_000000'" in b and "line 2" in b for b in report.bad)
    assert FeatureReader(tmp_path / "s").feature_dim == 64


def test_cli_import_of_empty_records_into_an_existing_store_takes_its_width(tmp_path, make_record):
    with FeatureWriter(tmp_path / "s", feature_dim=64) as w:
        w.put(make_record(0))
    (tmp_path / "in.tsv").write_text(tsv_line(make_record(1, num_boxes=0, feature_dim=64)))
    assert main(["features", "import", str(tmp_path / "in.tsv"), str(tmp_path / "s")]) == 0
    r = FeatureReader(tmp_path / "s")
    assert len(r) == 2 and r["img_000001"].features.shape == (0, 64)


# bottom-up-attention's tools/generate_tsv.py, restated: csv.DictWriter over these six names, base64 of
# the float32 boxes (N, 4) and pool5 features (N, D); width before height; no labels
BUTD_FIELDNAMES = ["image_id", "image_w", "image_h", "num_boxes", "boxes", "features"]


def butd_tsv(path, recs):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, delimiter="\t", fieldnames=BUTD_FIELDNAMES)  # rows end in \r\n
        for rec in recs:
            writer.writerow(
                {
                    "image_id": rec.img_id,
                    "image_w": rec.img_w,
                    "image_h": rec.img_h,
                    "num_boxes": rec.num_boxes,
                    "boxes": base64.b64encode(rec.boxes.astype(np.float32).tobytes()).decode(),
                    "features": base64.b64encode(rec.features.astype(np.float32).tobytes()).decode(),
                }
            )


def test_bottom_up_attention_tsv_imports_with_unknown_labels(tmp_path, make_record):
    recs = [make_record(i, num_boxes=n, img_id=str(9000 + i)) for i, n in enumerate([36, 10, 20])]
    assert all(r.img_w != r.img_h for r in recs)  # a swapped width/height would show
    butd_tsv(tmp_path / "trainval_36.tsv", recs)
    assert main(["features", "import", str(tmp_path / "trainval_36.tsv"), str(tmp_path / "s")]) == 0
    r = FeatureReader(tmp_path / "s")
    for rec in recs:
        got = r[rec.img_id]
        assert (got.img_h, got.img_w) == (rec.img_h, rec.img_w)
        np.testing.assert_array_equal(got.boxes, rec.boxes)
        np.testing.assert_array_equal(got.features, rec.features.astype(np.float16))
        # never invented: every label is the unknown id at confidence 0
        assert (got.objects_id == UNKNOWN_LABEL).all() and (got.attrs_id == UNKNOWN_LABEL).all()
        assert not got.objects_conf.any() and not got.attrs_conf.any()
        assert not got.labels_known
    provenance = r.meta["provenance"]
    assert provenance["imported_from"]["layout"] == "bottom-up-attention"
    assert provenance["imported_from"]["labels"] == "absent"
    assert provenance["unlabelled_records"] == 3


def test_labelled_and_unlabelled_imports_add_up_in_the_metadata(tmp_path, make_record):
    (tmp_path / "lxmert.tsv").write_text(tsv_line(make_record(0)))
    butd_tsv(tmp_path / "butd.tsv", [make_record(1), make_record(2)])
    assert main(["features", "import", str(tmp_path / "lxmert.tsv"), str(tmp_path / "s")]) == 0
    r = FeatureReader(tmp_path / "s")
    assert r.meta["provenance"]["imported_from"]["labels"] == "present"
    assert "unlabelled_records" not in r.meta["provenance"]
    r.close()
    assert main(["features", "import", str(tmp_path / "butd.tsv"), str(tmp_path / "s")]) == 0
    r = FeatureReader(tmp_path / "s")
    assert r["img_000000"].labels_known and not r["img_000001"].labels_known
    assert r.meta["provenance"]["unlabelled_records"] == 2


def test_an_unknown_layout_names_the_fields_it_saw_and_the_layouts_it_knows(tmp_path, make_record, caplog):
    (tmp_path / "odd.tsv").write_text("\t".join(tsv_line(make_record(0)).split("\t")[:8]) + "\n")
    assert main(["features", "import", str(tmp_path / "odd.tsv"), str(tmp_path / "s")]) == 1
    assert "line 1 (id 'img_000000'): 8 tab-separated fields, an unknown feature TSV layout" in caplog.text
    assert "10 for lxmert (img_id, img_h, img_w, objects_id" in caplog.text
    assert "6 for bottom-up-attention (img_id, img_w, img_h, num_boxes, boxes, features)" in caplog.text
    assert not (tmp_path / "s").exists()


def test_a_line_of_the_other_layout_is_a_bad_line(tmp_path, make_record):
    butd_tsv(tmp_path / "in.tsv", [make_record(0)])
    with open(tmp_path / "in.tsv", "a") as f:
        f.write(tsv_line(make_record(1)))
    items = list(read_tsv(tmp_path / "in.tsv"))
    assert items[0][1].img_id == "img_000000"
    assert isinstance(items[1][1], BadInputError)
    assert "line 2 (id 'img_000001'): expected 6 tab-separated fields, got 10" in str(items[1][1])


def test_a_record_without_boxes_is_refused_on_export_or_skipped_on_request(tmp_path, make_record, caplog):
    # the reason: LXMERT's loader cannot reshape the empty features of such a line
    (tmp_path / "empty.tsv").write_text(tsv_line(make_record(0, num_boxes=0)))
    with pytest.raises(ValueError, match="reshape"):
        lxmert_load_obj_tsv(tmp_path / "empty.tsv")

    with FeatureWriter(tmp_path / "s", feature_dim=64) as w:
        for rec in (make_record(1), make_record(2, num_boxes=0), make_record(3)):
            w.put(rec)
    out = tmp_path / "out.tsv"
    assert main(["features", "export", str(tmp_path / "s"), str(out)]) == 1
    assert "record 'img_000002' has no boxes" in caplog.text and "--skip-empty" in caplog.text
    assert not out.exists() and not (tmp_path / "out.tsv.partial").exists()

    caplog.clear()
    assert main(["features", "export", "--skip-empty", str(tmp_path / "s"), str(out)]) == 0
    assert "record 'img_000002' has no boxes: left out" in caplog.text
    assert [item["img_id"] for item in lxmert_load_obj_tsv(out)] == ["img_000001", "img_000003"]


def test_cli_import_of_an_adaptive_tsv_keeps_its_widest_record(tmp_path, make_record, same):
    """Bottom-up-attention's adaptive 10-100 boxes: the store is as wide as the widest line, not 36."""
    recs = [make_record(i, num_boxes=n) for i, n in enumerate([10, 72, 36])]
    (tmp_path / "in.tsv").write_text("".join(tsv_line(r) for r in recs))
    assert main(["features", "import", str(tmp_path / "in.tsv"), str(tmp_path / "s")]) == 0
    r = FeatureReader(tmp_path / "s")
    assert r.max_boxes == 72 and len(r) == 3
    for rec in recs:
        same(r[rec.img_id], rec, np.float16)


def test_a_num_boxes_of_5000_digits_names_the_file_and_line(tmp_path, caplog):
    """Issue 46: the width scan parsed it (Python refuses ints of over 4300 digits): a bare ValueError."""
    b64 = base64.b64encode(np.zeros(4, np.float32).tobytes()).decode()
    line = ["bad", "10", "10", "9" * 5000, b64, base64.b64encode(np.zeros(4, np.float32).tobytes()).decode()]
    (tmp_path / "in.tsv").write_text("\t".join(line) + "\n")
    assert main(["features", "import", str(tmp_path / "in.tsv"), str(tmp_path / "dst")]) == 1
    assert f"{tmp_path / 'in.tsv'} line 1" in caplog.text and "field num_boxes is b'9999" in caplog.text
