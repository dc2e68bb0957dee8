"""Merging shards and whole-store verification, through the library and the `xmodal features` CLI."""

from __future__ import annotations

import json
import os

import lmdb
import numpy as np
import pytest

from pipelines.cli import main
from storage import FeatureReader, FeatureWriter
from storage.merge import DuplicateIdError, merge_stores
from storage.metadata import META_DB, META_KEY, RECORDS_DB
from storage.verify import verify


def write(path, recs, **kw):
    with FeatureWriter(path, feature_dim=64, **kw) as w:
        for rec in recs:
            w.put(rec)


def test_merge_combines_shards(tmp_path, make_record, same):
    write(tmp_path / "a", [make_record(i) for i in range(0, 6)])
    write(tmp_path / "b", [make_record(i, num_boxes=60) for i in range(6, 9)], max_boxes=100)
    assert main(["features", "merge", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "m")]) == 0
    r = FeatureReader(tmp_path / "m")
    assert len(r) == 9 and r.max_boxes == 100
    for i in range(9):
        same(r[f"img_{i:06d}"], make_record(i, num_boxes=60 if i >= 6 else 36), np.float16)
    assert [m["count"] for m in r.meta["provenance"]["merged_from"]] == [6, 3]
    assert verify(tmp_path / "m").ok


def test_merge_keeps_the_sources_provenance_when_they_agree(tmp_path, make_record, caplog):
    made = {"preset": "vg-r101-c4", "config": {"min_size": 96}, "weights": "random"}
    write(tmp_path / "a", [make_record(0)], meta={**made, "versions": {"torch": "2.9"}})
    write(tmp_path / "b", [make_record(1)], meta={**made, "versions": {"torch": "2.10"}})
    write(tmp_path / "c", [make_record(2)], meta={**made, "config": {"min_size": 600}})
    merge_stores([tmp_path / "a", tmp_path / "b"], tmp_path / "ab")
    kept = FeatureReader(tmp_path / "ab").meta["provenance"]
    assert {k: kept[k] for k in made} == made and len(kept["merged_from"]) == 2  # library versions aside
    merge_stores([tmp_path / "ab", tmp_path / "c"], tmp_path / "abc")
    mixed = FeatureReader(tmp_path / "abc").meta["provenance"]
    assert set(mixed) == {"merged_from"}  # the sources disagree: no settings are claimed, and it is said
    assert "config differ between" in caplog.text and "records no detector settings" in caplog.text


def test_merge_refuses_duplicates_unless_first_wins(tmp_path, make_record, same):
    write(tmp_path / "a", [make_record(i) for i in range(3)])
    write(tmp_path / "b", [make_record(i + 10, img_id=f"img_{i:06d}") for i in range(1, 5)])
    with pytest.raises(DuplicateIdError, match=r"2 ids.*'img_000001' in .*a, .*b.*--first-wins"):
        merge_stores([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    assert not (tmp_path / "m").exists()
    assert merge_stores([tmp_path / "a", tmp_path / "b"], tmp_path / "m", first_wins=True).written == 5
    r = FeatureReader(tmp_path / "m")
    same(r["img_000001"], make_record(1), np.float16)
    same(r["img_000004"], make_record(14, img_id="img_000004"), np.float16)


def test_merge_converts_dtype_when_sources_differ(tmp_path, make_record, same):
    write(tmp_path / "a", [make_record(0)], dtype="float32")
    write(tmp_path / "b", [make_record(1)])
    assert merge_stores([tmp_path / "a", tmp_path / "b"], tmp_path / "m").written == 2
    r = FeatureReader(tmp_path / "m")
    assert r.dtype == "float32"
    same(r["img_000001"], make_record(1))


def _flip_byte(path, img_id, offset_from_end):
    env = lmdb.open(str(path), max_dbs=2)
    db = env.open_db(RECORDS_DB)
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(img_id.encode(), db=db))
        value[-offset_from_end] ^= 0x01
        txn.put(img_id.encode(), bytes(value), db=db)
    env.close()


def test_verify_catches_a_flipped_byte(tmp_path, make_record, capsys):
    write(tmp_path / "s", [make_record(i) for i in range(5)])
    assert main(["features", "verify", str(tmp_path / "s")]) == 0
    assert "5 records checked, 0 bad" in capsys.readouterr().out
    _flip_byte(tmp_path / "s", "img_000003", 100)
    report = verify(tmp_path / "s")
    assert [bad for bad, _ in report.bad] == ["img_000003"] and "checksum" in report.bad[0][1]
    assert main(["features", "verify", str(tmp_path / "s")]) == 1
    out = capsys.readouterr().out
    assert "BAD img_000003" in out and "1 bad" in out
    with pytest.raises(Exception, match="checksum"):
        merge_stores([tmp_path / "s"], tmp_path / "m")


def test_verify_reports_a_count_that_disagrees(tmp_path, make_record):
    write(tmp_path / "s", [make_record(i) for i in range(2)])
    env = lmdb.open(str(tmp_path / "s"), max_dbs=2)
    db = env.open_db(META_DB)
    with env.begin(write=True) as txn:
        meta = json.loads(txn.get(META_KEY, db=db))
        meta["count"] = 7
        txn.put(META_KEY, json.dumps(meta).encode(), db=db)
    env.close()
    report = verify(tmp_path / "s")
    assert not report.bad
    # the line every other command stops on (storage.contents), then verify's own count
    assert "its metadata record says count=7 but it holds 2 records" in report.problems[0]
    assert "metadata count 7 but 2" in report.problems[1]


def test_info_text_and_json(tmp_path, make_record, capsys):
    write(tmp_path / "s", [make_record(i) for i in range(3)], meta={"detector": "vg-r101-c4"})
    assert main(["features", "info", str(tmp_path / "s"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["count"], info["feature_dim"], info["dtype"], info["max_boxes"]) == (3, 64, "float16", 36)
    assert info["provenance"] == {"detector": "vg-r101-c4"} and info["size_on_disk"] > 3 * 64 * 36 * 2
    assert main(["features", "info", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "records    3" in out and "vg-r101-c4" in out
    assert main(["features", "info", str(tmp_path / "missing")]) == 1


@pytest.mark.parametrize("dst", ["file", "fifo", "link", "dangling", "file/sub"])
def test_merge_onto_something_not_a_directory_is_one_line(dst, tmp_path, make_record, caplog):
    """Issue 46: onto a file, a FIFO, a link or a path under a file: one line, the thing left untouched."""
    write(tmp_path / "a", [make_record(1)])
    (tmp_path / "file").write_text("keep me")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert main(["features", "merge", str(tmp_path / "a"), str(tmp_path / dst)]) == 1
    assert "cannot hold a feature store" in caplog.text and str(tmp_path / dst) in caplog.text
    assert (tmp_path / "file").read_text() == "keep me" and not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("onto", ["itself", "link", "dotted"])
def test_merge_onto_a_source_is_refused_before_anything_is_written(onto, tmp_path, make_record, caplog):
    """`merge S S`, or onto a link to S: refused before a writer exists, so S's files stay byte for byte."""
    write(tmp_path / "s", [make_record(i) for i in range(4)])
    (tmp_path / "link").symlink_to(tmp_path / "s")
    (tmp_path / "sub").mkdir()
    dst = {"itself": tmp_path / "s", "link": tmp_path / "link", "dotted": tmp_path / "sub" / ".." / "s"}[onto]
    before = {p.name: p.read_bytes() for p in (tmp_path / "s").iterdir()}
    assert main(["features", "merge", str(tmp_path / "s"), str(dst)]) == 1
    assert f"cannot merge into {dst}: it is the source" in caplog.text and "never written" in caplog.text
    assert {p.name: p.read_bytes() for p in (tmp_path / "s").iterdir()} == before
    assert "merged_from" not in FeatureReader(tmp_path / "s").meta["provenance"]
