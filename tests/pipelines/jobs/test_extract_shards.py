"""`xmodal extract --shards per-replica` on a local two-node Ray cluster (two raylets of 1 CPU each, told
apart by custom resources): a replica and the driver killed mid-job, a rerun, and every image exactly once
across the shards, bit-identical to an uninterrupted run."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from pipelines.jobs.image_inputs import InputError

from .test_extract import BOXES, TINY, config, make_images

N = 12

DRIVER = textwrap.dedent(
    """
    import sys
    import ray
    from pipelines.jobs.extract.driver import ExtractConfig, run_extract
    ray.init(address=sys.argv[3])  # the nodes run this checkout already: no code to ship
    cfg = ExtractConfig(inputs=[sys.argv[1]], out=sys.argv[2], address=sys.argv[3], min_boxes={boxes},
                        max_boxes={boxes}, overrides={tiny!r}, batch_size=1, unit_batches=2, workers=2,
                        shards="per-replica", progress=False, include_dashboard=False)
    run_extract(cfg)
    """
)


@pytest.fixture(scope="module")
def two_nodes():
    """A head and a worker node of 1 CPU each: a replica (0.75 CPU) and its decoder (0.25) fill a node, so
    the two replicas run on different nodes."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"node_a": 1},
            "object_store_memory": 128 << 20,
            "include_dashboard": False,
        },
    )
    cluster.add_node(num_cpus=1, resources={"node_b": 1}, object_store_memory=128 << 20)
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def shard_ids(root: Path) -> dict[str, list[str]]:
    from storage import FeatureReader
    from storage.shards import shards_of

    out = {}
    for shard in shards_of(root):
        reader = FeatureReader(shard, lock=True)
        out[shard.name] = list(reader.keys())
        reader.close()
    return out


@pytest.mark.slow
def test_kills_of_a_replica_and_the_driver_then_a_rerun_give_each_image_once(two_nodes, tmp_path):
    import psutil

    from pipelines.jobs.extract.driver import run_extract
    from storage import FeatureReader

    images = tmp_path / "images"
    ids = make_images(images, N, seed=3)
    (images / "empty.jpg").write_bytes(b"")

    # the uninterrupted run
    whole = tmp_path / "whole"
    first = run_extract(config(images, whole, batch_size=1, unit_batches=2, workers=2, shards="per-replica"))
    assert (first.done, first.failed, first.replicas) == (N, 1, 2)
    per_shard = shard_ids(whole)
    assert sorted(per_shard) == ["shard-000", "shard-001"] and all(per_shard.values())
    assert sorted(i for v in per_shard.values() for i in v) == ids

    # the killed run: a driver of its own joins the cluster; a replica dies once the shards hold
    # something, then the driver, with its replicas still running
    out = tmp_path / "killed"
    code = DRIVER.format(boxes=BOXES, tiny=TINY)
    log_path = tmp_path / "driver.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, str(images), str(out), two_nodes.address],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        killed_replica = False
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(Exception):  # the shards are being created: look again
                held = sum(map(len, shard_ids(out).values()))
                if not killed_replica and held >= 2:
                    for child in psutil.Process().children(recursive=True):
                        with contextlib.suppress(psutil.Error):
                            if " ".join(child.cmdline()).startswith("ray::Replica"):
                                child.send_signal(signal.SIGKILL)
                                killed_replica = True
                                break
                elif killed_replica and held >= N // 2:
                    break
            time.sleep(0.05)
        assert proc.poll() is None, f"the job ended before it could be killed: {log_path.read_text()[-3000:]}"
        assert killed_replica
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    before = shard_ids(out)
    assert 0 < sum(map(len, before.values())) < N

    # the rerun starts at once, while the killed driver's replicas may still be finishing a unit
    rerun = run_extract(config(images, out, batch_size=1, unit_batches=2, workers=2, shards="per-replica"))
    after = shard_ids(out)
    everything = [i for v in after.values() for i in v]
    assert sorted(everything) == ids, "an image is missing or in two shards"
    assert rerun.failed == 1 and rerun.done + rerun.skipped == N
    for name, held in before.items():
        assert set(held) <= set(after[name])  # nothing committed was lost or moved

    a, b = FeatureReader(whole), FeatureReader(out)
    for img_id in ids:
        x, y = a[img_id], b[img_id]
        assert (x.img_h, x.img_w) == (y.img_h, y.img_w)
        for field in ("boxes", "features", "objects_id", "objects_conf", "attrs_id", "attrs_conf"):
            np.testing.assert_array_equal(getattr(x, field), getattr(y, field), err_msg=f"{img_id} {field}")
    assert a.meta["provenance"]["extract_settings"] == b.meta["provenance"]["extract_settings"]


def test_a_shard_set_refuses_other_settings_and_the_other_layout_by_name(tmp_path):
    """Before Ray starts, naming the shard or the store."""
    from pipelines.jobs.extract.driver import run_extract
    from storage import FeatureWriter
    from storage.shards import shard_path, write_manifest

    images = tmp_path / "images"
    make_images(images, 2)
    root = tmp_path / "feats"
    write_manifest(root, {}, "old")
    other = {
        "extract_settings": {"preset": "vg-r101-c4", "selection": "caffe", "min_boxes": 3, "max_boxes": 6}
    }
    FeatureWriter(shard_path(root, 1), feature_dim=2048, max_boxes=BOXES, meta=other).close()
    with pytest.raises(InputError, match=r"shard-001 was extracted with other settings \(min_boxes: 3 -> 6"):
        run_extract(config(images, root, shards="per-replica"))
    with pytest.raises(InputError, match="is a shard set .* resume it with --shards per-replica"):
        run_extract(config(images, root))
    single = tmp_path / "one.lmdb"
    FeatureWriter(single, feature_dim=2048, max_boxes=BOXES).close()
    with pytest.raises(InputError, match="one.lmdb is a single store"):
        run_extract(config(images, single, shards="per-replica"))
