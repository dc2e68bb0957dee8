"""`xmodal extract` on generated folders: ids, store == direct detection, failures, resume, kill -9."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipelines.image_inputs import InputError, iter_images, unique_ids

# A small network (random weights) and small inputs keep each image well under a second on 2 cores.
TINY = dict(min_size=64, max_size=96, post_nms_topk=12, pooler_resolution=1, blocks_per_stage=(1, 1, 1))
BOXES = 6
N_GOOD = 16
BROKEN = {"truncated", "empty", "notes", "dangling", "huge"}
KILL_N = 8


def make_images(folder: Path, n: int, seed: int = 0) -> list[str]:
    """n small random pictures (JPEG and PNG, assorted sizes); returns their ids (stems)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    ids = []
    for i in range(n):
        h, w = (int(x) for x in rng.integers(40, 130, size=2))
        pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        pixels[h // 4 : h // 2, w // 3 : 2 * w // 3] = rng.integers(0, 256, size=3)
        img_id = f"img_{i:03d}"
        Image.fromarray(pixels).save(folder / f"{img_id}.{'png' if i % 3 == 0 else 'jpg'}", quality=95)
        ids.append(img_id)
    return ids


def make_broken(folder: Path) -> None:
    """The bad inputs users have: truncated, empty, not an image, unreadable, too large."""
    good = folder / "for_truncation.jpg"
    Image.fromarray(np.full((64, 64, 3), 128, np.uint8)).save(good, quality=95)
    data = good.read_bytes()
    good.unlink()
    (folder / "truncated.jpg").write_bytes(data[: len(data) // 2])
    (folder / "empty.jpg").write_bytes(b"")
    (folder / "notes.jpg").write_text("this is a text file, not a picture\n")
    # Tests run as root, which reads any file whatever its mode: a dangling link is unreadable for everyone.
    os.symlink(folder / "no_such_file.jpg", folder / "dangling.jpg")
    Image.new("1", (8000, 8000)).save(folder / "huge.png")  # 64 MP: above the decoder's limit


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("images")
    make_images(folder, N_GOOD)
    make_broken(folder)
    return folder


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray instance for the module's in-process runs (each ray.init costs seconds)."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=256 << 20)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(image_dir) -> dict:
    """Direct Detector.detect on each good image, with the thread count of a replica sharing 2 CPUs.

    One image per call, as the job below runs it, so that even the images a dead replica leaves behind
    (retried one by one) must come out bit-identical.
    """
    import torch

    from extraction import Detector, ImageError, load_image

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        det = Detector.build(min_boxes=BOXES, max_boxes=BOXES, **TINY)
        out = {}
        for item in iter_images([image_dir]):
            try:
                image = load_image(item.path)
            except ImageError:
                continue
            out[item.img_id] = det.detect([image], [item.img_id])[0]
    finally:
        torch.set_num_threads(threads)
    return out


def config(image_dir: Path, out: Path, **kw):
    from pipelines.extract import ExtractConfig

    base = dict(
        inputs=[str(image_dir)],
        out=str(out),
        min_boxes=BOXES,
        max_boxes=BOXES,
        overrides=dict(TINY),
        batch_size=3,
        progress=False,
    )
    return ExtractConfig(**{**base, **kw})


def assert_store_matches(store: Path, reference: dict) -> None:
    from storage import FeatureReader

    reader = FeatureReader(store)
    assert sorted(reader.keys()) == sorted(reference)
    for img_id, want in reference.items():
        got = reader[img_id]
        assert (got.img_h, got.img_w) == (want.img_h, want.img_w)
        np.testing.assert_array_equal(got.boxes, want.boxes)
        np.testing.assert_array_equal(got.objects_id, want.objects_id)
        np.testing.assert_array_equal(got.attrs_id, want.attrs_id)
        np.testing.assert_array_equal(got.objects_conf, want.objects_conf)
        np.testing.assert_array_equal(got.features, want.features.astype(reader.dtype))
    reader.close()


def read_errors(store: Path) -> dict[str, dict]:
    from pipelines.extract import errors_path

    lines = errors_path(store).read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return {row["img_id"]: row for row in rows}


# ---- listing and ids (no Ray) ----


def test_ids_by_stem_and_relpath_with_recursion_and_list_files(tmp_path):
    make_images(tmp_path / "a", 2)
    make_images(tmp_path / "a" / "sub", 1, seed=1)
    (tmp_path / "a" / "readme.txt").write_text("not listed: not an image suffix")
    listing = tmp_path / "list.txt"
    listing.write_text("# comment\n\na/img_000.png\n")

    flat = list(iter_images([tmp_path / "a"]))
    assert [(i.img_id, Path(i.path).name) for i in flat] == [
        ("img_000", "img_000.png"),
        ("img_001", "img_001.jpg"),
    ]
    deep = [i.img_id for i in iter_images([tmp_path / "a"], recursive=True, id_from="relpath")]
    assert deep == ["img_000.png", "img_001.jpg", "sub/img_000.png"]
    assert [(i.img_id, i.path) for i in iter_images([listing])] == [
        ("img_000", str(tmp_path / "a" / "img_000.png"))
    ]


def test_duplicate_ids_fail_before_any_work_naming_both_files(tmp_path):
    from pipelines.extract import run_extract

    make_images(tmp_path / "a" / "x", 1)
    make_images(tmp_path / "a" / "y", 1)
    with pytest.raises(InputError, match="img_000") as exc:
        unique_ids([tmp_path / "a"], recursive=True)
    assert "x/img_000.png" in str(exc.value) and "y/img_000.png" in str(exc.value)
    assert len(unique_ids([tmp_path / "a"], recursive=True, id_from="relpath")) == 2

    out = tmp_path / "feats.lmdb"
    with pytest.raises(InputError, match="duplicate"):
        run_extract(config(tmp_path / "a", out, recursive=True))
    assert not out.exists()  # refused before Ray started or the store was created


def test_missing_input_and_empty_folder_are_clear_errors(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        unique_ids([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="--recursive"):
        unique_ids([tmp_path / "empty"])


# ---- the Ray job, in process ----


@pytest.mark.slow
def test_two_replicas_store_equals_direct_detection_and_survives_a_replica_kill(
    image_dir, ray_session, reference, tmp_path
):
    """Two CPU replicas, one SIGKILLed mid-run: restarted, its images retried, the store still exact."""
    import psutil

    from pipelines.cli import main
    from pipelines.extract import run_extract, summary_path

    out = tmp_path / "feats.lmdb"
    killed: list[int] = []
    finished = threading.Event()

    def kill_one_replica() -> None:
        while not finished.is_set():
            for proc in psutil.Process().children(recursive=True):
                try:
                    if " ".join(proc.cmdline()).startswith("ray::_Replica.detect"):
                        proc.send_signal(signal.SIGKILL)
                        killed.append(proc.pid)
                        return
                except psutil.Error:
                    continue
            time.sleep(0.05)

    killer = threading.Thread(target=kill_one_replica, daemon=True)
    killer.start()
    try:
        summary = run_extract(config(image_dir, out, workers=2, batch_size=1))
    finally:
        finished.set()
        killer.join()

    assert killed, "no replica was found running to kill"
    assert summary.replicas == 2 and summary.restarts >= 1
    assert (summary.total, summary.done, summary.skipped, summary.failed) == (N_GOOD + 5, N_GOOD, 0, 5)
    assert summary.exit_code == 2  # failures above the default --max-failures 0
    assert json.loads(summary_path(out).read_text())["done"] == N_GOOD
    assert_store_matches(out, reference)

    errors = read_errors(out)
    assert set(errors) == BROKEN
    for img_id, row in errors.items():
        assert Path(row["path"]).stem == img_id and row["reason"]
    assert "0-byte" in errors["empty"]["reason"] and "MP" in errors["huge"]["reason"]

    from storage import FeatureReader

    meta = FeatureReader(out).meta
    prov = meta["provenance"]
    assert prov["preset"] == "vg-r101-c4" and prov["selection"] == "caffe" and prov["weights"] == "random"
    assert prov["extract_settings"]["overrides"]["min_size"] == 64 and "torch" in prov["versions"]

    # resume: nothing detected again, only the broken files retried, and tolerated this time
    again = run_extract(config(image_dir, out, max_failures=len(BROKEN)))
    assert (again.done, again.skipped, again.failed, again.exit_code) == (0, N_GOOD, 5, 0)
    assert set(read_errors(out)) == BROKEN  # this run's failures, not an accumulation
    # the CLI cannot shrink the network like TINY does: resuming with other settings is refused up front
    argv = ["extract", str(image_dir), "--out", str(out), "--min-size", "64", "--max-size", "96"]
    assert main([*argv, "--min-boxes", str(BOXES), "--max-boxes", str(BOXES)]) == 1


# ---- kill -9 of the whole job, then resume ----

DRIVER = textwrap.dedent(
    """
    import sys
    from pipelines.extract import ExtractConfig, run_extract
    cfg = ExtractConfig(inputs=[sys.argv[1]], out=sys.argv[2], min_boxes={boxes}, max_boxes={boxes},
                        overrides={tiny!r}, batch_size=2, workers=1, commit_seconds=0.2, progress=False,
                        include_dashboard=False)
    run_extract(cfg)
    """
)


@pytest.mark.slow
def test_sigkill_mid_run_then_rerun_gives_every_image_exactly_once(ray_session, tmp_path):
    import psutil

    from pipelines.extract import run_extract
    from storage import FeatureReader

    image_dir = tmp_path / "images"
    ids = make_images(image_dir, KILL_N, seed=2)
    (image_dir / "empty.jpg").write_bytes(b"")
    out = tmp_path / "killed.lmdb"
    log_path = tmp_path / "driver.log"
    code = DRIVER.format(boxes=BOXES, tiny=TINY)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, str(image_dir), str(out)],
            start_new_session=True,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    family = {psutil.Process(proc.pid)}
    committed = 0
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                family.update(psutil.Process(proc.pid).children(recursive=True))
            if (out / "data.mdb").is_file():
                try:
                    reader = FeatureReader(out, lock=True)
                    committed = len(reader)
                    reader.close()
                except Exception:  # the store is being created: look again
                    committed = 0
                if committed:
                    break
            time.sleep(0.1)
        assert proc.poll() is None, f"the job ended before it could be killed: {log_path.read_text()[-2000:]}"
        assert 0 < committed < KILL_N
    finally:
        with contextlib.suppress(psutil.Error):
            family.update(psutil.Process(proc.pid).children(recursive=True))
        # Ray workers run in process groups of their own: signal the driver's group, then each process
        os.killpg(proc.pid, signal.SIGKILL)
        for member in family:
            with contextlib.suppress(psutil.Error):
                member.kill()
        proc.wait()
        psutil.wait_procs(family, timeout=15)
        assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    reader = FeatureReader(out)
    before = len(reader)  # what the killed run had committed (at least what we saw)
    reader.close()
    assert before >= committed
    rerun = run_extract(config(image_dir, out, batch_size=3))
    reader = FeatureReader(out)
    assert len(reader) == KILL_N and sorted(reader.keys()) == ids
    assert (rerun.skipped, rerun.done, rerun.failed) == (before, KILL_N - before, 1)
    reader.close()
