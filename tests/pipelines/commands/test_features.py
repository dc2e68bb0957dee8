"""`xmodal features ls`: record ids a page at a time, as text or JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipelines.cli import main
from storage import FeatureWriter, RegionFeatures


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
