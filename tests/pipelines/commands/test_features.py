"""`xmodal features ls` (record ids a page at a time, as text or JSON) and `merge --salvage` (a corrupt
source record stops a plain merge, exit 1 in one line, and is left out, logged, by a salvaging one)."""

from __future__ import annotations

import json

import lmdb
import numpy as np
import pytest

from pipelines.cli import main
from storage import FeatureReader, FeatureWriter, RegionFeatures
from storage.metadata import RECORDS_DB


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("ls") / "feats.lmdb"
    with FeatureWriter(path, feature_dim=4, max_boxes=2) as writer:
        for i in (3, 0, 2, 1, 4):
            writer.put(
                RegionFeatures(
                    img_id=f"img{i}", img_h=10, img_w=10, boxes=np.array([[0, 0, 5, 5]], np.float32),
                    features=np.ones((1, 4), np.float32), objects_id=np.zeros(1, np.int64),
                    objects_conf=np.ones(1, np.float32), attrs_id=np.zeros(1, np.int64),
                    attrs_conf=np.ones(1, np.float32),
                )
            )  # fmt: skip
    return path


def test_ls_pages_through_the_ids_in_key_order(store, capsys):
    assert main(["features", "ls", str(store), "--limit", "2"]) == 0
    out = capsys.readouterr()
    assert out.out.split() == ["img0", "img1"]
    assert "1-2 of 5; next page: --offset 2" in out.err
    assert main(["features", "ls", str(store), "--offset", "2", "--limit", "0"]) == 0
    out = capsys.readouterr()
    assert out.out.split() == ["img2", "img3", "img4"] and out.err == ""


def test_ls_json(store, capsys):
    assert main(["features", "ls", str(store), "--offset", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"total": 5, "offset": 4, "ids": ["img4"]}


def test_ls_refuses_a_negative_page_and_a_missing_store(store, tmp_path, caplog):
    assert main(["features", "ls", str(store), "--offset", "-1"]) == 1
    assert "--offset and --limit" in caplog.text
    assert main(["features", "ls", str(tmp_path / "nope.lmdb")]) == 1


def _record(i: int) -> RegionFeatures:
    rng = np.random.default_rng(i)
    boxes = np.sort(rng.uniform(0, 50, (3, 2, 2)), axis=1).reshape(3, 4)[:, [0, 2, 1, 3]]
    return RegionFeatures(
        img_id=f"img{i}",
        img_h=60,
        img_w=60,
        boxes=boxes.astype(np.float32),
        features=rng.random((3, 8), dtype=np.float32),
        objects_id=np.arange(3),
        objects_conf=np.full(3, 0.5, np.float32),
        attrs_id=np.arange(3),
        attrs_conf=np.full(3, 0.5, np.float32),
    )


def test_salvage_leaves_out_the_corrupt_record_and_exits_partial(tmp_path, caplog, capsys):
    src = tmp_path / "a.lmdb"
    with FeatureWriter(src, feature_dim=8, max_boxes=3) as writer:
        for i in range(5):
            writer.put(_record(i))
    env = lmdb.open(str(src), max_dbs=2)
    with env.begin(write=True) as txn:
        db = env.open_db(RECORDS_DB, txn=txn)
        value = bytearray(txn.get(b"img2", db=db))
        value[-1] ^= 0xFF  # one flipped byte: the checksum no longer matches
        txn.put(b"img2", bytes(value), db=db)
    env.close()
    assert main(["features", "merge", str(src), str(tmp_path / "plain.lmdb")]) == 1
    assert "img2" in caplog.text
    caplog.clear()
    # what was saved is kept, and the status says the merge is partial (2), not a success
    assert main(["features", "merge", "--salvage", str(src), str(tmp_path / "kept.lmdb")]) == 2
    assert "left out" in caplog.text and "img2" in caplog.text
    assert "PARTIAL: 1 damaged pages or records left out" in capsys.readouterr().err
    assert sorted(FeatureReader(tmp_path / "kept.lmdb").keys()) == ["img0", "img1", "img3", "img4"]


def test_show_refuses_a_picture_of_another_size(store, tmp_path, caplog):
    from PIL import Image

    Image.new("RGB", (12, 10)).save(tmp_path / "other.png")  # the records were extracted from 10x10
    argv = ["features", "show", str(store), "img1", "--image", str(tmp_path / "other.png")]
    assert main([*argv, "--out", str(tmp_path / "drawn.png")]) == 1
    err = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(err) == 1 and "is 12x10 but 'img1' was extracted from a 10x10 picture" in err[0], err
    assert "\n" not in err[0]
    assert not (tmp_path / "drawn.png").exists()
    Image.new("RGB", (10, 10)).save(tmp_path / "same.png")
    argv = ["features", "show", str(store), "img1", "--image", str(tmp_path / "same.png")]
    assert main([*argv, "--out", str(tmp_path / "drawn.png")]) == 0
    assert (tmp_path / "drawn.png").is_file()


def test_a_reader_that_stops_early_is_no_error(store):
    """`xmodal features ls STORE | head -1`: the pipe closes before xmodal writes; no traceback, exit 0."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    argv = [sys.executable, "-m", "pipelines.cli", "features", "ls", str(store), "--limit", "0"]
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line is written
    proc = subprocess.run(argv, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120, env=env)
    os.close(write)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stderr


def test_show_draws_the_regions_above_a_score_and_says_how_many(tmp_path, capsys):
    """Issue 45: as the demo's pictures, regions scored 0.5 or more by default (always the best one)."""
    from PIL import Image

    path = tmp_path / "feats.lmdb"
    scores = np.array([0.9, 0.2, 0.6, 0.1], np.float32)
    boxes = np.array([[k, k, k + 9, k + 9] for k in (0, 10, 20, 30)], np.float32)
    with FeatureWriter(path, feature_dim=4, max_boxes=4) as writer:
        writer.put(
            RegionFeatures(
                img_id="a", img_h=40, img_w=40, boxes=boxes, features=np.ones((4, 4), np.float32),
                objects_id=np.zeros(4, np.int64), objects_conf=scores, attrs_id=np.zeros(4, np.int64),
                attrs_conf=np.ones(4, np.float32),
            )
        )  # fmt: skip
    Image.new("RGB", (40, 40)).save(tmp_path / "a.png")
    argv = ["features", "show", str(path), "a", "--image", str(tmp_path / "a.png")]
    argv += ["--out", str(tmp_path / "d.png")]
    for extra, drawn in (([], 2), (["--min-score", "0"], 4), (["--min-score", "0.95"], 1)):
        assert main([*argv, *extra]) == 0
        assert f"{drawn} of the 4 regions of 'a' drawn" in capsys.readouterr().out
