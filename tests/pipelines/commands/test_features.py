"""`xmodal features merge --salvage`: a corrupt source record stops a plain merge (exit 1, one line) and is
left out, logged, by a salvaging one."""

from __future__ import annotations

import lmdb
import numpy as np

from pipelines.cli import main as xmodal
from storage import FeatureReader, FeatureWriter, RegionFeatures
from storage.metadata import RECORDS_DB


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


def test_salvage_leaves_out_the_corrupt_record(tmp_path, caplog):
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
    assert xmodal(["features", "merge", str(src), str(tmp_path / "plain.lmdb")]) == 1
    assert "img2" in caplog.text
    caplog.clear()
    assert xmodal(["features", "merge", "--salvage", str(src), str(tmp_path / "kept.lmdb")]) == 0
    assert "left out" in caplog.text and "img2" in caplog.text
    assert sorted(FeatureReader(tmp_path / "kept.lmdb").keys()) == ["img0", "img1", "img3", "img4"]
