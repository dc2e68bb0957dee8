"""Shard sets: one directory read as one store, merged into one file, shards made differently refused by
name, and the writer claim that keeps a replaced job from committing."""

from __future__ import annotations

import pickle
import threading
import time

import pytest

from pipelines.cli import main
from storage import FeatureReader, FeatureWriter, StoreError
from storage.merge import merge_stores
from storage.shards import (
    StaleWriterError,
    claim,
    shard_path,
    write_manifest,
    writing,
)

SETTINGS = {"preset": "vg-r101-c4", "extract_settings": {"max_boxes": 36}}


def make_set(root, parts, make_record, provenance=SETTINGS, token="job-1"):
    """A shard set under `root` whose shard i holds the records of indices parts[i]."""
    write_manifest(root, provenance, token)
    for i, indices in enumerate(parts):
        with FeatureWriter(shard_path(root, i), feature_dim=64, meta=dict(provenance)) as writer:
            for index in indices:
                writer.put(make_record(index))
    return root


def test_a_shard_set_reads_as_one_store_everywhere(tmp_path, make_record, same, capsys):
    root = make_set(tmp_path / "feats", [[0, 2, 4], [1, 3]], make_record)
    reader = FeatureReader(root)
    assert len(reader) == 5 and reader.paths == [root / "shard-000", root / "shard-001"]
    assert sorted(reader.keys()) == [f"img_{i:06d}" for i in range(5)]
    for i in range(5):
        same(reader[f"img_{i:06d}"], make_record(i))
    assert reader.meta["provenance"]["preset"] == "vg-r101-c4"
    clone = pickle.loads(pickle.dumps(reader))  # as a DataLoader worker receives it
    assert clone.paths == reader.paths and len(clone) == 5

    assert main(["features", "info", "--json", str(root)]) == 0
    assert '"count": 5' in capsys.readouterr().out
    assert main(["features", "verify", str(root)]) == 0


def test_merge_makes_one_file_from_a_shard_set(tmp_path, make_record, same):
    root = make_set(tmp_path / "feats", [[0, 2], [1, 3]], make_record)
    merged = tmp_path / "one.lmdb"
    assert merge_stores([root], merged).written == 4
    reader = FeatureReader(merged)
    assert len(reader) == 4 and reader.meta["provenance"]["preset"] == "vg-r101-c4"
    for i in range(4):
        same(reader[f"img_{i:06d}"], make_record(i))


def test_a_shard_made_with_other_settings_is_refused_by_name(tmp_path, make_record):
    root = make_set(tmp_path / "feats", [[0], [1]], make_record)
    other = {"preset": "vg-r101-c4", "extract_settings": {"max_boxes": 10}}
    with FeatureWriter(shard_path(root, 2), feature_dim=64, meta=other) as writer:
        writer.put(make_record(2))
    with pytest.raises(
        StoreError, match=r"shard .*shard-002 of .*feats was made differently .*extract_settings"
    ):
        len(FeatureReader(root))
    with pytest.raises(StoreError, match="shard-002"):
        merge_stores([root], tmp_path / "one.lmdb")
    assert not (tmp_path / "one.lmdb").exists()


def test_a_set_without_shards_says_so(tmp_path):
    write_manifest(tmp_path / "feats", {}, "job-1")
    with pytest.raises(FileNotFoundError, match="holds no shard yet"):
        FeatureReader(tmp_path / "feats")


def test_a_replaced_job_cannot_write_and_a_claim_waits_for_a_commit_in_progress(tmp_path, make_record):
    root = make_set(tmp_path / "feats", [[0]], make_record, token="old")
    shard = shard_path(root, 0)
    inside, release, claimed = threading.Event(), threading.Event(), threading.Event()

    def old_commit() -> None:
        with writing(shard, "old"):
            inside.set()
            release.wait(10)

    def new_claim() -> None:
        claim(root, "new")
        claimed.set()

    committing = threading.Thread(target=old_commit)
    committing.start()
    assert inside.wait(10)
    claimer = threading.Thread(target=new_claim)
    claimer.start()
    time.sleep(0.3)
    assert not claimed.is_set()  # the old job's commit in progress is waited for...
    release.set()
    committing.join()
    claimer.join()
    assert claimed.is_set()
    # ...and nothing it sends later is written
    with (
        pytest.raises(StaleWriterError, match="a later extraction job has taken over"),
        writing(shard, "old"),
    ):
        pass
    with writing(shard, "new"):
        pass


def test_ids_held_by_several_shards_are_listed_once_with_a_warning(tmp_path, make_record, same, caplog):
    for name, indices in (("a", [0, 1, 2]), ("b", [2, 3, 1])):
        with FeatureWriter(tmp_path / name, feature_dim=64) as writer:
            for index in indices:
                writer.put(make_record(index, num_boxes=2 + index + (name == "b")))
    reader = FeatureReader([tmp_path / "a", tmp_path / "b"])
    with caplog.at_level("WARNING", logger="storage.reader"):
        ids = list(reader.keys())
    assert sorted(ids) == [make_record(i).img_id for i in range(4)]  # each once
    warned = [r.getMessage() for r in caplog.records if "held by several shards" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("2 ids are held by several shards"), warned
    assert str(tmp_path / "a") in warned[0] and str(tmp_path / "b") in warned[0]
    assert reader[make_record(2).img_id].num_boxes == 4  # the first shard's record (a's, 2 + 2)
    caplog.clear()
    with caplog.at_level("WARNING", logger="storage.reader"):
        assert list(FeatureReader(tmp_path / "a").keys()) == [make_record(i).img_id for i in range(3)]
        assert list(FeatureReader([tmp_path / "a"]).keys()) and not caplog.records
