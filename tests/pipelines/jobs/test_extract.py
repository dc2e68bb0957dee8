"""`xmodal extract` on generated folders: ids, store == direct detection, failures, resume, kill -9;
the driver's retry bookkeeping and the resource plan against a fake Ray."""

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
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from pipelines.jobs.image_inputs import InputError, iter_images, unique_ids

# A small network (random weights) and small inputs keep each image well under a second on 2 cores.
TINY = dict(min_size=64, max_size=96, post_nms_topk=12, pooler_resolution=1, blocks_per_stage=(1, 1, 1))
BOXES = 6
N_GOOD = 16
BROKEN = {"truncated", "empty", "notes", "dangling", "huge", "pipe", "zero"}
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
    os.mkfifo(folder / "pipe.jpg")  # reading it would wait for a writer forever
    os.symlink("/dev/zero", folder / "zero.jpg")  # reading it would fill memory


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


def _detect(items: list, batch: int) -> dict:
    """Direct Detector.detect over `items` in batches of `batch`, unreadable images left out, with the
    thread count of a replica sharing 2 CPUs."""
    import torch

    from extraction import Detector, ImageError, load_image

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        det = Detector.build(min_boxes=BOXES, max_boxes=BOXES, **TINY)
        out = {}
        for start in range(0, len(items), batch):
            images, ids = [], []
            for item in items[start : start + batch]:
                try:
                    images.append(load_image(item.path))
                    ids.append(item.img_id)
                except ImageError:
                    continue
            if ids:
                out.update((rec.img_id, rec) for rec in det.detect(images, ids))
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def reference(image_dir) -> dict:
    """Each good image detected alone, as the job below runs it, so that even the images a dead replica
    leaves behind (retried one by one) must come out bit-identical."""
    return _detect(list(iter_images([image_dir])), batch=1)


def config(image_dir: Path, out: Path, **kw):
    from pipelines.jobs.extract.driver import ExtractConfig

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
    from pipelines.jobs.extract.driver import errors_path

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


def test_a_non_utf8_name_gets_an_escaped_id_and_is_read(tmp_path):
    from pipelines.jobs.extract.actors import decode_images

    make_images(tmp_path / "a", 1)
    os.rename(tmp_path / "a" / "img_000.png", os.fsencode(tmp_path / "a") + b"/caf\xe9.png")
    listing = tmp_path / "list.txt"
    listing.write_bytes(b"a/caf\xe9.png\n")
    for source, id_from, want in ((tmp_path / "a", "relpath", "caf\\xe9.png"), (listing, "stem", "caf\\xe9")):
        (item,) = iter_images([source], id_from=id_from)
        assert item.img_id == want and item.img_id.encode("utf-8")
        assert unique_ids([source], id_from=id_from) == {want}
        batch = decode_images([item], timeout=10)
        assert batch.ids == [want] and not batch.failures


def test_symlinked_folders_are_followed_once_and_loops_are_warned(tmp_path, caplog):
    make_images(tmp_path / "root" / "real", 1)
    make_images(tmp_path / "elsewhere", 1, seed=1)
    os.symlink(tmp_path / "elsewhere", tmp_path / "root" / "linked")
    os.symlink(tmp_path / "root", tmp_path / "root" / "real" / "back")  # a loop
    os.symlink(tmp_path / "root" / "real", tmp_path / "root" / "also")  # a second way to a folder
    ids = [i.img_id for i in iter_images([tmp_path / "root"], recursive=True, id_from="relpath")]
    assert ids == ["real/img_000.png", "linked/img_000.png"]  # real sub-folders first, then links
    assert "root/real/back" in caplog.text and "root/also" in caplog.text and "already listed" in caplog.text
    assert list(iter_images([tmp_path / "root"])) == []  # without --recursive no folder is entered


def test_a_decode_past_the_timeout_is_skipped_and_the_batch_goes_on(tmp_path, monkeypatch):
    import extraction
    from pipelines.jobs.extract.actors import decode_images
    from pipelines.jobs.image_inputs import ImageInput

    real = extraction.load_image
    release = threading.Event()

    def stalls(path, *args, **kwargs):
        if "img_000" in str(path):
            release.wait(30)  # a read stuck on a dead network mount
        return real(path, *args, **kwargs)

    monkeypatch.setattr(extraction, "load_image", stalls)
    make_images(tmp_path, 2)
    items = [
        ImageInput("stall", str(tmp_path / "img_000.png")),
        ImageInput("ok", str(tmp_path / "img_001.jpg")),
    ]
    t0 = time.monotonic()
    batch = decode_images(items, timeout=0.3)
    release.set()
    assert time.monotonic() - t0 < 5
    assert batch.ids == ["ok"]
    ((img_id, why),) = batch.failures
    assert img_id == "stall" and "not read and decoded within 0.3s (--decode-timeout)" in why


def test_decoder_threads_keep_the_order_and_a_stalled_image_holds_up_no_other(tmp_path, monkeypatch):
    import extraction
    from pipelines.jobs.extract.actors import decode_images
    from pipelines.jobs.image_inputs import ImageInput

    real = extraction.load_image
    release = threading.Event()
    seen_at_once, lock, running = [0], threading.Lock(), [0]

    def slow(path, *args, **kwargs):
        with lock:
            running[0] += 1
            seen_at_once[0] = max(seen_at_once[0], running[0])
        try:
            if "img_001" in str(path):
                release.wait(30)
            else:
                time.sleep(0.05)
            return real(path, *args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(extraction, "load_image", slow)
    make_images(tmp_path, 6)
    items = [ImageInput(p.stem, str(p)) for p in sorted(tmp_path.iterdir())]
    t0 = time.monotonic()
    batch = decode_images(items, timeout=1.0, working=(64, 96), threads=3)
    release.set()
    assert time.monotonic() - t0 < 5
    assert batch.ids == [i.img_id for i in items if i.img_id != "img_001"]  # in order, the stall left out
    assert [f[0] for f in batch.failures] == ["img_001"] and "--decode-timeout" in batch.failures[0][1]
    assert 1 < seen_at_once[0] <= 3
    assert all(min(im.shape[:2]) == 64 or max(im.shape[:2]) == 96 for im in batch.images)


@pytest.mark.parametrize("forward", ["per-image", "batched"])
def test_decoders_resize_to_the_working_size_and_replicas_write_what_detect_gives(forward, tmp_path):
    """Only working-size pixels cross to the replica (with the originals' sizes), and its records equal
    `Detector.detect` on the files bit for bit, on either forward path."""
    import torch

    from pipelines.jobs.extract.actors import Replica, decode_images
    from pipelines.jobs.extract.config import build_kwargs, working_size

    make_images(tmp_path / "imgs", 5)
    items = list(iter_images([tmp_path / "imgs"]))
    cfg = config(tmp_path / "imgs", tmp_path / "x.lmdb", forward=forward)
    assert working_size(cfg) == (TINY["min_size"], TINY["max_size"])
    batch = decode_images(items, timeout=10, working=working_size(cfg))
    for item, image, size in zip(items, batch.images, batch.sizes, strict=True):
        with Image.open(item.path) as original:
            assert size == (original.height, original.width)
        assert min(image.shape[:2]) == TINY["min_size"] or max(image.shape[:2]) == TINY["max_size"]
    threads = torch.get_num_threads()
    try:
        replica = Replica(build_kwargs(cfg, "cpu"), threads=1)
        assert replica.det.forward_path == forward
        records, failures = replica.detect(batch)
        want = replica.det.detect([i.path for i in items], [i.img_id for i in items])
    finally:
        torch.set_num_threads(threads)
    assert not failures and [r.img_id for r in records] == [w.img_id for w in want]
    for got, exp in zip(records, want, strict=True):
        assert (got.img_h, got.img_w) == (exp.img_h, exp.img_w)
        np.testing.assert_array_equal(got.boxes, exp.boxes)
        np.testing.assert_array_equal(got.features, exp.features)


def test_a_batched_record_does_not_depend_on_the_job_batch_size(tmp_path):
    """The job's --batch-size only says how many images travel together: the network runs at the detector's
    own call shape (recorded in the provenance), so every record is bit for bit the same at 1, 4 or 6."""
    import torch

    from pipelines.jobs.extract.actors import Replica, decode_images
    from pipelines.jobs.extract.config import build_kwargs, working_size

    make_images(tmp_path / "imgs", 7, seed=3)
    items = list(iter_images([tmp_path / "imgs"]))
    threads = torch.get_num_threads()
    runs = {}
    try:
        for size in (1, 4, 6):
            cfg = config(tmp_path / "imgs", tmp_path / "x.lmdb", forward="batched", batch_size=size)
            replica = Replica(build_kwargs(cfg, "cpu"), threads=1)
            shape = replica.det.provenance()["call_shape"]
            assert shape["forward"] == "batched" and shape["canvases"] == replica.det.forward_batch
            records = []
            for start in range(0, len(items), size):
                chunk = items[start : start + size]
                got, failures = replica.detect(decode_images(chunk, timeout=10, working=working_size(cfg)))
                assert not failures
                records.extend(got)
            runs[size] = records
    finally:
        torch.set_num_threads(threads)
    fields = ("boxes", "features", "objects_id", "objects_conf", "attrs_id", "attrs_conf")
    for size in (4, 6):
        assert [r.img_id for r in runs[size]] == [r.img_id for r in runs[1]]
        for got, want in zip(runs[size], runs[1], strict=True):
            for field in fields:
                np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)


def test_duplicate_ids_fail_before_any_work_naming_both_files(tmp_path):
    from pipelines.jobs.extract.driver import run_extract

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


def test_a_named_file_that_is_not_an_image_is_refused_before_ray_starts(tmp_path, caplog):
    from pipelines.cli import main

    good = tmp_path / "good.png"
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(good)
    notes = tmp_path / "notes.pdf"
    notes.write_text("%PDF-1.4")
    fake = tmp_path / "fake.jpg"
    fake.write_text("not a jpeg")
    for bad, reason in ((notes, "is not an image"), (fake, "is not a readable image")):
        with pytest.raises(InputError, match=reason):
            unique_ids([good, bad])
        out = tmp_path / f"{bad.stem}.lmdb"
        assert main(["extract", str(good), str(bad), "--out", str(out), "--workers", "1"]) == 1
        assert str(bad) in caplog.text and not out.exists()
    assert unique_ids([good]) == {"good"}


def test_an_id_longer_than_a_store_key_is_refused_before_any_work_naming_the_file(tmp_path):
    from pipelines.jobs.extract.driver import run_extract

    deep = tmp_path / "a" / ("d" * 200) / ("e" * 200) / ("f" * 200)
    make_images(deep, 1)
    with pytest.raises(InputError, match="511") as exc:
        unique_ids([tmp_path / "a"], recursive=True, id_from="relpath")
    assert str(deep / "img_000.png") in str(exc.value) and "--id-from stem" in str(exc.value)
    assert unique_ids([tmp_path / "a"], recursive=True) == {"img_000"}

    out = tmp_path / "feats.lmdb"
    with pytest.raises(InputError, match="511"):
        run_extract(config(tmp_path / "a", out, recursive=True, id_from="relpath"))
    assert not out.exists()


def test_the_listing_and_the_store_share_one_id_limit(tmp_path):
    """An id the listing lets through is one the store can key, up to the last byte."""
    from storage import RegionFeatures
    from storage.codec import MAX_ID_BYTES, encode

    def record(img_id: str) -> RegionFeatures:
        def empty(*shape, dtype="<f4"):
            return np.zeros((0, *shape), dtype)

        return RegionFeatures(
            img_id, 8, 8, empty(4), empty(2), empty(dtype="<i8"), empty(), empty(dtype="<i8"), empty()
        )

    folders = Path("d" * 200) / ("e" * 200)  # file names hold 255 bytes: longer ids need folders
    for size in (MAX_ID_BYTES, MAX_ID_BYTES + 1):
        root = tmp_path / str(size)
        name = "f" * (size - len(str(folders)) - len("/.png"))
        make_images(root / folders, 1)
        (root / folders / "img_000.png").rename(root / folders / f"{name}.png")
        img_id = f"{folders}/{name}.png"
        assert len(img_id.encode()) == size
        if size <= MAX_ID_BYTES:
            assert unique_ids([root], recursive=True, id_from="relpath") == {img_id}
            assert encode(record(img_id))
        else:
            with pytest.raises(InputError, match=f"{size} bytes long"):
                unique_ids([root], recursive=True, id_from="relpath")
            with pytest.raises(ValueError, match=f"{size} bytes long"):
                encode(record(img_id))


# ---- the driver loop against a fake Ray: which attempts a dead replica costs ----


class FakeRef:
    def __init__(self, result=None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error


class FakeRay:
    """Stands in for `ray` in pipelines.jobs.extract.pool: calls run when submitted; `wait` hands back the
    oldest or the newest result first (when an actor dies, which of its failed calls the driver sees first
    is a race).
    """

    def __init__(self, newest_first: bool = False) -> None:
        import ray

        self.exceptions = ray.exceptions
        self.newest_first = newest_first

    def wait(self, refs, num_returns=1, timeout=None):
        order = refs[::-1] if self.newest_first else refs
        return order[:num_returns], order[num_returns:]

    def get(self, ref: FakeRef):
        if ref.error is not None:
            raise ref.error
        return ref.result

    def kill(self, actor) -> None:
        actor.alive = False


class FakeReplica:
    """Dies (with every call queued behind) on a batch holding a poisonous image; None: on every batch.
    Each batch it is given goes to `calls` as (slot, ids)."""

    def __init__(self, poison: set[str] | None, slot: int = 0, calls: list | None = None) -> None:
        self.poison = poison
        self.slot = slot
        self.calls = calls if calls is not None else []
        self.alive = True
        self.detect = SimpleNamespace(remote=self._detect)

    def _detect(self, items):
        import ray

        self.calls.append((self.slot, [i.img_id for i in items]))
        if self.poison is None or any(i.img_id in self.poison for i in items):
            self.alive = False
        if not self.alive:
            return FakeRef(error=ray.exceptions.RayActorError(error_msg="The actor died unexpectedly"))
        return FakeRef(result=([i.img_id for i in items], []))


class FakeDecoder:
    alive = True
    decode = SimpleNamespace(remote=lambda items: items)


class FakeWriter:
    def __init__(self) -> None:
        self.stored: list[str] = []

    def put(self, rec: str) -> bool:
        self.stored.append(rec)
        return True

    def flush(self) -> None:
        pass


def fake_job(
    monkeypatch,
    tmp_path,
    batches: list[list[str]],
    poison: set[str] | None,
    workers=1,
    newest_first=False,
    broken: frozenset[int] = frozenset(),
    calls: list | None = None,
    sink=None,
):
    """A `_Job` on fake replicas, and its batches of `ImageInput`s named by id. The replicas of the slots
    in `broken` die on every batch; every batch a replica is given goes to `calls` as (slot, ids)."""
    from pipelines.jobs.extract import pool as extract
    from pipelines.jobs.extract.config import ExtractConfig
    from pipelines.jobs.extract.sinks import StoreSink
    from pipelines.jobs.image_inputs import ImageInput

    monkeypatch.setattr(extract, "ray", FakeRay(newest_first))

    def replica_cls(slot: int) -> SimpleNamespace:
        slot_poison = None if slot in broken else poison
        return SimpleNamespace(remote=lambda build, threads: FakeReplica(slot_poison, slot, calls))

    decoder_cls = SimpleNamespace(remote=lambda timeout: FakeDecoder())
    slots = [extract.Slot(replica_cls(i), decoder_cls, {}, 1, 60.0) for i in range(workers)]
    cfg = ExtractConfig(inputs=[], out=str(tmp_path / "f.lmdb"), batch_size=2, progress=False)
    job = extract.Job(cfg, sink or StoreSink(FakeWriter()), slots, sum(map(len, batches)))
    units = (extract.Unit([ImageInput(i, f"/images/{i}.jpg") for i in batch]) for batch in batches)
    return job, units


class FakeShards:
    """A shard set as the driver sees it: replicas return the ids they committed; `dead_commits`: the ids
    a replica had committed when it died (its report of them lost)."""

    def __init__(self, dead_commits: set[str]) -> None:
        self.dead_commits = dead_commits
        self.taken: list[str] = []
        self.asked: list[tuple[int, list[str]]] = []

    def take(self, ids: list[str]) -> int:
        self.taken.extend(ids)
        return len(ids)

    def flush(self) -> None:
        pass

    def committed(self, slot: int, ids) -> set[str]:
        ids = list(ids)
        self.asked.append((slot, ids))
        return self.dead_commits & set(ids)


@pytest.mark.parametrize("newest_first", [False, True], ids=["oldest-first", "newest-first"])
def test_what_a_dead_replica_committed_to_its_shard_is_never_handed_out_again(
    monkeypatch, tmp_path, newest_first
):
    """The replica died after committing ['p', 'a'] but before saying so: those two are done (asked of its
    shard once every call of it came back) and are never given to a replica again, so they cannot land
    in a second shard. The batch behind them is now the oldest that failed, so it is charged (split and
    retried alone), as if the replica had died on it; no image is failed."""
    calls: list = []
    batches = [["p", "a"], ["b", "c"], ["d", "e"]]
    sink = FakeShards({"p", "a"})
    job, units = fake_job(
        monkeypatch, tmp_path, batches, poison={"p"}, newest_first=newest_first, calls=calls, sink=sink
    )
    job.run(units)

    assert sink.asked == [(0, ["p", "a", "b", "c"])]
    assert sorted(sink.taken) == ["b", "c", "d", "e"]
    assert (job.done, job.failed, job.restarts) == (6, 0, 1)
    given = [ids for _, ids in calls]
    assert given.count(["p", "a"]) == 1 and ["p"] not in given and ["a"] not in given
    assert given.count(["b", "c"]) == 1 and ["b"] in given and ["c"] in given
    assert read_errors(tmp_path / "f.lmdb") == {}


@pytest.mark.parametrize("newest_first", [False, True], ids=["oldest-first", "newest-first"])
def test_a_dead_replica_charges_only_the_batch_it_died_on(monkeypatch, tmp_path, newest_first):
    """'p' kills its replica every time: its batch-mate 'a' and the batch queued behind ('b', 'c') are
    retried without running out of attempts; 'p' alone is given up, after exactly 3 attempts."""
    batches = [["p", "a"], ["b", "c"], ["d", "e"]]
    job, units = fake_job(monkeypatch, tmp_path, batches, poison={"p"}, newest_first=newest_first)
    job.run(units)

    assert sorted(job.sink.writer.stored) == ["a", "b", "c", "d", "e"]
    assert (job.done, job.failed, job.restarts) == (5, 1, 3)
    errors = read_errors(tmp_path / "f.lmdb")
    assert list(errors) == ["p"] and errors["p"]["path"] == "/images/p.jpg"
    assert errors["p"]["reason"].startswith("gave up after 3 attempts: its replica or decoder died")


@pytest.mark.parametrize("workers", [1, 2])
def test_every_batch_in_flight_poisonous_stays_under_the_restart_limit(monkeypatch, tmp_path, workers):
    n_bad = 2 * 2 * workers  # batch_size x DEPTH x workers: everything the replicas hold at once
    ids = [f"bad{i}" for i in range(n_bad)] + [f"ok{i}" for i in range(6)]
    batches = [ids[i : i + 2] for i in range(0, len(ids), 2)]
    job, units = fake_job(monkeypatch, tmp_path, batches, poison=set(ids[:n_bad]), workers=workers)
    job.run(units)

    assert sorted(job.sink.writer.stored) == sorted(ids[n_bad:])
    assert sorted(read_errors(tmp_path / "f.lmdb")) == sorted(ids[:n_bad])
    assert job.restarts <= job.restart_limit


def test_replicas_that_never_finish_a_batch_stop_the_job(monkeypatch, tmp_path):
    from pipelines.jobs.extract.driver import JobError

    batches = [[f"img{i}", f"img{i + 1}"] for i in range(0, 200, 2)]
    job, units = fake_job(monkeypatch, tmp_path, batches, poison=None)
    with pytest.raises(JobError, match="died 14 times in a row without finishing a batch"):
        job.run(units)
    assert job.restart_limit == 3 * 2 * 1 * 2 + 1 and job.restarts == 14
    assert job.failed < 10  # not every image of the input marked failed, one restart at a time


def test_the_batches_a_death_interrupted_come_back_whole(monkeypatch, tmp_path):
    """Only the batch a replica died on is split; ['b', 'c'], queued behind it, is retried as it was."""
    calls: list = []
    batches = [["p", "a"], ["b", "c"]]
    job, units = fake_job(monkeypatch, tmp_path, batches, poison={"p"}, calls=calls)
    job.run(units)

    assert sorted(job.sink.writer.stored) == ["a", "b", "c"] and job.failed == 1
    given = [ids for _, ids in calls]
    assert given.count(["b", "c"]) == 2 and ["b"] not in given and ["c"] not in given
    assert ["p"] in given and ["a"] in given


@pytest.mark.parametrize(("workers", "broken"), [(2, {0}), (4, {0, 1, 2})], ids=["1-of-2", "3-of-4"])
def test_replicas_that_always_die_among_healthy_ones_are_retired_and_cost_no_image(
    monkeypatch, tmp_path, caplog, workers, broken
):
    """Broken replicas never finish a batch while a healthy one does: each is retired after its own
    run of deaths, the images it held go to the healthy replica, and none is recorded as failed."""
    from pipelines.jobs.extract.pool import DEPTH

    calls: list = []
    ids = [f"img{i:04d}" for i in range(800)]
    batches = [ids[i : i + 2] for i in range(0, len(ids), 2)]
    job, units = fake_job(
        monkeypatch, tmp_path, batches, poison=set(), workers=workers, broken=frozenset(broken), calls=calls
    )
    job.run(units)

    assert sorted(job.sink.writer.stored) == ids
    assert job.failed == 0 and read_errors(tmp_path / "f.lmdb") == {}
    assert [s.retired for s in job.slots] == [i in broken for i in range(workers)]
    assert job.restarts == len(broken) * (job.restart_limit + 1)
    for slot in sorted(broken):
        assert f"replica {slot} died {job.restart_limit + 1} times in a row without finishing a batch" in (
            caplog.text
        )
    assert "retired" in caplog.text
    # a retired replica is given nothing more (DEPTH batches per life), and a retried image never goes
    # to a broken replica while the healthy one is there to take it
    for slot in broken:
        assert sum(1 for s, _ in calls if s == slot) == DEPTH * (job.restart_limit + 1)
    tried_alone_on = {s for s, batch in calls if len(batch) == 1}
    assert tried_alone_on and not tried_alone_on & broken


def test_a_culprit_is_retried_on_another_replica_than_the_one_it_died_on(monkeypatch, tmp_path):
    """'p' poisons every replica: its retries visit the other replica before coming back."""
    calls: list = []
    batches = [["p", "a"], ["b", "c"], ["d", "e"], ["f", "g"]]
    job, units = fake_job(monkeypatch, tmp_path, batches, poison={"p"}, workers=2, calls=calls)
    job.run(units)

    assert sorted(job.sink.writer.stored) == list("abcdefg") and job.failed == 1
    slots_of_p = [s for s, ids in calls if "p" in ids]
    assert len(slots_of_p) == 3 and slots_of_p[0] != slots_of_p[1]


def test_when_every_replica_is_retired_the_job_stops(monkeypatch, tmp_path):
    from pipelines.jobs.extract.driver import JobError

    batches = [[f"img{i}", f"img{i + 1}"] for i in range(0, 400, 2)]
    job, units = fake_job(monkeypatch, tmp_path, batches, poison=None, workers=2)
    with pytest.raises(JobError, match="every replica was retired"):
        job.run(units)
    assert all(s.retired for s in job.slots)
    assert job.restarts == 2 * (job.restart_limit + 1)


# ---- resources and connection, with Ray's answers mocked ----


def test_a_replica_reservation_fits_on_the_largest_node(monkeypatch, caplog):
    import ray

    from pipelines.jobs.extract.config import ExtractConfig
    from pipelines.jobs.extract.plan import DECODE_CPUS, plan_resources

    nodes = [
        {"Alive": True, "Resources": {"CPU": 2.0, "GPU": 1.0}},
        {"Alive": True, "Resources": {"CPU": 2.0, "GPU": 1.0}},
        {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}},  # a dead node offers nothing
    ]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4.0})

    def plan(**kw):
        return plan_resources(ExtractConfig(inputs=[], out="f.lmdb", **kw), local=False)

    one = plan()
    assert (one.workers, one.cpus, one.threads, one.device) == (1, 2.0 - DECODE_CPUS, 2, "cpu")
    assert plan(workers=2).cpus == 1.75 and plan(workers=4).cpus == 0.75
    assert "would" not in caplog.text
    assert plan(cpus_per_worker=3.0).cpus == 3.0  # on a cluster an autoscaler may add a larger node...
    assert "largest node has 2" in caplog.text
    with pytest.raises(InputError, match="largest node has 2"):  # ...on this machine nothing will
        plan_resources(ExtractConfig(inputs=[], out="f.lmdb", cpus_per_worker=3.0), local=True)

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4.0, "GPU": 2.0})
    gpu = plan()
    assert (gpu.workers, gpu.gpus, gpu.cpus, gpu.device) == (2, 1.0, 1.0, "cuda")
    with pytest.raises(InputError, match="largest node has 1"):
        plan_resources(ExtractConfig(inputs=[], out="f.lmdb", gpus_per_worker=2.0), local=True)


def test_a_gpu_replica_counts_only_the_cpus_of_nodes_with_its_gpus(monkeypatch, caplog):
    """The compose cluster: a head with CPUs and no GPU, a worker with one GPU and 2 CPUs."""
    import ray

    from pipelines.jobs.extract.config import ExtractConfig
    from pipelines.jobs.extract.plan import DECODE_CPUS, plan_resources

    nodes = [
        {"Alive": True, "Resources": {"CPU": 8.0}},
        {"Alive": True, "Resources": {"CPU": 2.0, "GPU": 1.0}},
    ]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 10.0, "GPU": 1.0})

    def plan(local=False, **kw):
        return plan_resources(ExtractConfig(inputs=[], out="f.lmdb", **kw), local=local)

    assert plan(cpus_per_worker=1.5).cpus == 1.5
    with pytest.raises(InputError, match="the largest node with 1 GPU.* has 2"):
        plan(local=True, cpus_per_worker=4.0)
    assert plan(cpus_per_worker=4.0).cpus == 4.0 and "largest node with 1 GPU(s) has 2" in caplog.text
    cpu = plan(gpus_per_worker=0.0)  # a CPU replica may take the head's 8
    assert (cpu.device, cpu.cpus) == ("cpu", 8.0 - DECODE_CPUS)


# ---- the Ray job, in process ----


@pytest.mark.slow
def test_two_replicas_store_equals_direct_detection_and_survives_a_replica_kill(
    image_dir, ray_session, reference, tmp_path
):
    """Two CPU replicas, one SIGKILLed mid-run: restarted, its images retried, the store still exact."""
    import psutil

    from pipelines.cli import main
    from pipelines.jobs.extract.driver import run_extract, summary_path

    out = tmp_path / "feats.lmdb"
    killed: list[int] = []
    finished = threading.Event()

    def kill_one_replica() -> None:
        while not finished.is_set():
            for proc in psutil.Process().children(recursive=True):
                try:
                    if " ".join(proc.cmdline()).startswith("ray::Replica.detect"):
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
    assert (summary.total, summary.done, summary.skipped, summary.failed) == (
        N_GOOD + len(BROKEN),
        N_GOOD,
        0,
        len(BROKEN),
    )
    assert summary.exit_code == 2  # failures above the default --max-failures 0
    assert json.loads(summary_path(out).read_text())["done"] == N_GOOD
    assert_store_matches(out, reference)

    errors = read_errors(out)
    assert set(errors) == BROKEN
    for img_id, row in errors.items():
        assert Path(row["path"]).stem == img_id and row["reason"]
    assert "0-byte" in errors["empty"]["reason"] and "MP" in errors["huge"]["reason"]
    assert "named pipe" in errors["pipe"]["reason"] and "character device" in errors["zero"]["reason"]

    from storage import FeatureReader

    meta = FeatureReader(out).meta
    prov = meta["provenance"]
    assert prov["preset"] == "vg-r101-c4" and prov["selection"] == "caffe" and prov["weights"] == "random"
    assert prov["extract_settings"]["overrides"]["min_size"] == 64 and "torch" in prov["versions"]

    # resume: nothing detected again, only the broken files retried, and tolerated this time
    again = run_extract(config(image_dir, out, max_failures=len(BROKEN)))
    assert (again.done, again.skipped, again.failed, again.exit_code) == (0, N_GOOD, len(BROKEN), 0)
    assert set(read_errors(out)) == BROKEN  # this run's failures, not an accumulation
    # the CLI cannot shrink the network like TINY does: resuming with other settings is refused up front
    argv = ["extract", str(image_dir), "--out", str(out), "--min-size", "64", "--max-size", "96"]
    assert main([*argv, "--min-boxes", str(BOXES), "--max-boxes", str(BOXES)]) == 1


@pytest.mark.slow
def test_batched_store_equals_detect_on_the_same_batches(image_dir, ray_session, reference, tmp_path):
    """batch_size 3 on a store that already holds two ids: every record equals `Detector.detect` on the
    batch the job formed (listing order, stored ids left out, undecodable files dropped), bit for bit."""

    from pipelines.jobs.extract.driver import run_extract
    from storage import FeatureWriter

    out = tmp_path / "batched.lmdb"
    stored = ["img_001", "img_005"]  # as a resumed run finds them: the batches form around them
    writer = FeatureWriter(out, feature_dim=reference["img_000"].features.shape[1], max_boxes=BOXES)
    for img_id in stored:
        writer.put(reference[img_id])
    writer.close()

    summary = run_extract(config(image_dir, out, workers=1, cpus_per_worker=1.0, batch_size=3))
    assert (summary.done, summary.skipped, summary.failed) == (N_GOOD - len(stored), len(stored), len(BROKEN))

    todo = [item for item in iter_images([image_dir]) if item.img_id not in stored]
    want = {img_id: reference[img_id] for img_id in stored}
    want.update(_detect(todo, batch=3))
    assert_store_matches(out, want)


@pytest.mark.slow
def test_replicas_the_cluster_cannot_place_stop_after_the_startup_timeout(
    image_dir, ray_session, tmp_path, caplog
):
    """On a cluster (here the test's Ray, joined with --address auto) an unplaceable request only warns at
    planning, in case an autoscaler adds nodes; --startup-timeout then ends the wait with exit 1."""
    from pipelines.cli import main

    out = tmp_path / "feats.lmdb"
    argv = ["extract", str(image_dir), "--out", str(out), "--address", "auto", "--cpus-per-worker", "5"]
    t0 = time.monotonic()
    assert main([*argv, "--startup-timeout", "2"]) == 1
    assert time.monotonic() - t0 < 60
    assert "not started after 2s (--startup-timeout)" in caplog.text
    assert "asked for 1 replica(s) of 5 CPU" in caplog.text and "the cluster has 2 CPU" in caplog.text
    assert not out.exists()


# ---- kill -9 of the whole job, then resume ----

DRIVER = textwrap.dedent(
    """
    import sys
    from pipelines.jobs.extract.driver import ExtractConfig, run_extract
    cfg = ExtractConfig(inputs=[sys.argv[1]], out=sys.argv[2], min_boxes={boxes}, max_boxes={boxes},
                        overrides={tiny!r}, batch_size=2, workers=1, commit_seconds=0.2, progress=False,
                        include_dashboard=False)
    run_extract(cfg)
    """
)


@pytest.mark.slow
def test_sigkill_mid_run_then_rerun_gives_every_image_exactly_once(ray_session, tmp_path):
    import psutil

    from pipelines.jobs.extract.driver import run_extract
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


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch /nonexistent/ran",))


def _no_ray(*args, **kwargs):
    raise AssertionError("Ray was started before the refusal")


@pytest.mark.parametrize("suffix", [".bin", ".pkl", ".pt"])
def test_a_bad_weights_file_is_one_line_before_ray_starts(suffix, tmp_path, monkeypatch):
    import pickle

    import torch

    from pipelines.jobs.extract import driver
    from pipelines.jobs.extract.driver import run_extract

    monkeypatch.setattr(driver, "init_ray", _no_ray)

    images = tmp_path / "images"
    make_images(images, 1)
    weights = tmp_path / f"evil{suffix}"
    if suffix == ".pkl":
        weights.write_bytes(pickle.dumps({"model": _RunsCode()}))
    else:
        torch.save({"model": _RunsCode()}, weights)
    with pytest.raises(InputError) as err:
        run_extract(config(images, tmp_path / "f.lmdb", weights=str(weights)))
    message = str(err.value)
    assert "\n" not in message and f"detector checkpoint {str(weights)!r} cannot be read" in message
    assert "system" in message  # names what it would have run
    assert not (tmp_path / "f.lmdb").exists()


def test_a_store_of_another_shape_is_refused_before_ray_starts(tmp_path, monkeypatch):
    from extraction import Detector
    from extraction.config import resolve_config
    from pipelines.jobs.extract import driver
    from pipelines.jobs.extract.driver import run_extract
    from storage import FeatureWriter

    monkeypatch.setattr(driver, "init_ray", _no_ray)

    config_, _ = resolve_config("vg-r101-c4", **{k: v for k, v in TINY.items() if "size" not in k})
    assert config_.feature_dim == Detector.build(**TINY).feature_dim == 2048
    images = tmp_path / "images"
    make_images(images, 1)
    store = tmp_path / "f.lmdb"
    FeatureWriter(store, feature_dim=64, max_boxes=BOXES, dtype="float16").close()
    with pytest.raises(
        InputError, match=r"f\.lmdb holds records of another shape: feature_dim 64 \(this job: 2048\)"
    ):
        run_extract(config(images, store))


# ---- grid features ----


@pytest.mark.slow
def test_a_grid_job_equals_detecting_each_image_alone_and_resumes(image_dir, ray_session, tmp_path):
    """`--features grid`: the same job (decoders, replicas, errors file, resume) writes each image's cells,
    bit for bit those of `Detector.detect` on that image alone, in a store sized to the grid."""
    import torch

    from extraction import Detector, ImageError, load_image
    from pipelines.jobs.extract.driver import run_extract
    from storage import FeatureReader

    out = tmp_path / "grid.lmdb"
    cfg = config(image_dir, out, features="grid", grid="4x3", workers=1, cpus_per_worker=1.0)
    summary = run_extract(cfg)
    assert (summary.done, summary.failed) == (N_GOOD, len(BROKEN))
    assert set(read_errors(out)) == BROKEN

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        det = Detector.build(grid="4x3", **TINY)
        reader = FeatureReader(out)
        assert reader.max_boxes == 12 and reader.meta["provenance"]["features"] == "grid"
        assert reader.meta["provenance"]["extract_settings"]["grid"] == "4x3"
        for item in iter_images([image_dir]):
            try:
                image = load_image(item.path)
            except ImageError:
                continue
            want = det.detect([image], [item.img_id])[0]
            got = reader[item.img_id]
            assert got.num_boxes == 12
            np.testing.assert_array_equal(got.boxes, want.boxes)
            np.testing.assert_array_equal(got.objects_id, want.objects_id)
            np.testing.assert_array_equal(got.attrs_id, want.attrs_id)
            np.testing.assert_array_equal(got.features, want.features.astype(reader.dtype))
        reader.close()
    finally:
        torch.set_num_threads(threads)
    again = run_extract(cfg)
    assert (again.done, again.skipped) == (0, N_GOOD)


def test_a_grid_store_is_not_resumed_as_regions_nor_with_another_grid(tmp_path, monkeypatch):
    from pipelines.jobs.extract import driver
    from pipelines.jobs.extract.config import check_same_settings, recorded_settings
    from pipelines.jobs.extract.driver import run_extract
    from storage import FeatureWriter

    monkeypatch.setattr(driver, "init_ray", _no_ray)
    images = tmp_path / "images"
    make_images(images, 1)
    store = tmp_path / "g.lmdb"
    grid_cfg = config(images, store, features="grid", grid="14x14")
    settings = recorded_settings(grid_cfg, {"weights_sha256": None})
    FeatureWriter(store, feature_dim=2048, max_boxes=196, meta={"extract_settings": settings}).close()
    with pytest.raises(InputError, match=r"features: 'grid' -> 'regions'"):
        run_extract(config(images, store))
    with pytest.raises(InputError, match=r"grid: '14x14' -> 'native/2'"):
        run_extract(config(images, store, features="grid", grid="native/2"))
    # the same cells from res5 at stride 32 are other features: not appended to a stride-16 store
    with pytest.raises(InputError, match=r"grid: '14x14' -> '14x14@32'"):
        run_extract(config(images, store, features="grid", grid="14x14@32"))
    # a region store written before grid features existed records no `features`: still resumable as regions
    old = {
        k: v
        for k, v in recorded_settings(config(images, store), None).items()
        if k not in ("features", "grid")
    }
    check_same_settings(store, old, recorded_settings(config(images, store), None))
    with pytest.raises(InputError, match="features: 'regions' -> 'grid'"):
        check_same_settings(store, old, settings)
