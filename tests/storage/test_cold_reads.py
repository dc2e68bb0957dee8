"""Reads ask the disk for every value of a batch before touching any, and check whose record each value is.

Values of 36 x 64 float16 regions (~4.6 kB) live on LMDB overflow pages; the tests find them in data.mdb
by their bytes and by the leaf node's page number, independently of storage.btree."""

from __future__ import annotations

import struct
import time

import pytest

import storage.codec
import storage.reader
from storage import FeatureReader, FeatureWriter
from storage.environment import StoreDamagedError

PAGE = 4096
COUNT = 8


@pytest.fixture
def store(tmp_path, make_record):
    path = tmp_path / "s"
    with FeatureWriter(path, feature_dim=64) as w:
        for i in range(COUNT):
            w.put(make_record(i))
    return path


def value_pages(path, ids) -> set[int]:
    """The offsets in data.mdb of the pages a read of the ids touches past the branch pages: the leaf
    holding each id's node and its value's pages (with the overflow page header before it), found by
    the values' bytes and the keys in the file."""
    reader = FeatureReader(path)
    data = (path / "data.mdb").read_bytes()
    out = set()
    for img_id in ids:
        value = reader.get_encoded(img_id)
        assert data.count(value) == 1
        start = data.index(value)
        out |= {p * PAGE for p in range(start // PAGE, (start + len(value) - 1) // PAGE + 1)}
        out.add(leaf_pointer(data, img_id) // PAGE * PAGE)
    reader.close()  # the readers tested open the store afresh
    return out


def runs(pages: set[int]) -> int:
    """How many runs of consecutive pages `pages` make."""
    return sum(1 for p in pages if p - PAGE not in pages)


def pages_of(ranges) -> list[int]:
    """The pages of page-aligned (offset, size) ranges, repeats kept."""
    assert all(start % PAGE == 0 and size % PAGE == 0 for start, size in ranges), ranges
    return [start + k * PAGE for start, size in ranges for k in range(size // PAGE)]


def leaf_pointer(data: bytes, img_id: str) -> int:
    """Offset in `data` of the overflow page number that `img_id`'s leaf node holds (after its key)."""
    key = img_id.encode()
    for start in range(0, len(data), PAGE):
        flags = struct.unpack_from("<H", data, start + 10)[0]
        if flags & 0x02:  # a leaf page
            at = data.find(key, start, start + PAGE)
            if at >= 0:
                return at + len(key)
    raise AssertionError(f"no leaf holds {img_id}")


@pytest.fixture
def in_memory(monkeypatch):
    """Whether the reader finds the values it probes in the page cache: False (a cold store, as these
    small stores are not) unless a test sets it."""
    state = [False]
    monkeypatch.setattr(storage.reader._Shard, "_in_memory", lambda self, spans: state[0])
    return state


@pytest.fixture
def calls(monkeypatch, in_memory):
    """The order of disk requests and decodes: ("request", ranges) and ("decode", id) entries."""
    log: list[tuple[str, object]] = []
    request, decode = storage.reader.request_ranges, storage.codec.decode

    def recording_request(fd, ranges, *piece):
        log.append(("request", {(start, size) for start, size in ranges}))
        request(fd, ranges, *piece)

    def recording_decode(value, key=None):
        log.append(("decode", key.decode()))
        return decode(value, key)

    monkeypatch.setattr(storage.reader, "request_ranges", recording_request)
    monkeypatch.setattr(storage.codec, "decode", recording_decode)
    return log


def test_a_batch_requests_exactly_its_values_before_decoding_any(store, calls, make_record):
    ids = ["img_000005", "img_000001", "img_000003", "img_000005"]
    expected = value_pages(store, set(ids))
    reader = FeatureReader(store)
    calls.clear()
    batch = reader.read_batch(ids)
    kinds = [kind for kind, _ in calls]
    assert kinds == ["request", "decode", "decode", "decode"], kinds
    # the three values' pages, each once, and nothing of the records between them
    assert sorted(pages_of(calls[0][1])) == sorted(expected)
    assert len(calls[0][1]) == runs(expected)
    assert [img_id for kind, img_id in calls if kind == "decode"] == ids[:3]
    assert list(batch.img_ids) == ids
    for row, img_id in enumerate(ids):
        want = make_record(int(img_id[-1]))
        assert (batch.features[row, : want.num_boxes].astype("float32") == want.features).all()


def test_adjacent_values_are_one_request(store, calls):
    """Values stored next to each other are asked for as one range, not one each."""
    ids = [f"img_{i:06d}" for i in range(COUNT)]
    expected = value_pages(store, ids)
    reader = FeatureReader(store)
    calls.clear()
    reader.read_batch(ids)
    (kind, ranges), *_ = calls
    assert kind == "request"
    assert sorted(pages_of(ranges)) == sorted(expected)
    assert len(ranges) == runs(expected) < len(ids)


def test_one_record_is_requested_whole_before_it_is_read(store, calls):
    reader = FeatureReader(store)
    expected = value_pages(store, ["img_000004"])
    calls.clear()
    assert reader["img_000004"].img_id == "img_000004"
    assert [kind for kind, _ in calls] == ["request", "decode"]
    assert sorted(pages_of(calls[0][1])) == sorted(expected)


def test_a_value_past_the_file_is_still_refused_and_never_requested(store, calls):
    data = bytearray((store / "data.mdb").read_bytes())
    struct.pack_into("<Q", data, leaf_pointer(data, "img_000002"), 10**6)
    (store / "data.mdb").write_bytes(bytes(data))
    reader = FeatureReader(store)
    calls.clear()
    with pytest.raises(StoreDamagedError, match="img_000002"):
        reader.read_batch(["img_000001", "img_000002"])
    assert ("decode", "img_000002") not in calls
    requests = [ranges for kind, ranges in calls if kind == "request"]
    assert requests
    for ranges in requests:
        assert all(start + length <= len(data) for start, length in ranges), ranges
    assert reader.read_batch(["img_000001", "img_000003"]).features.shape[0] == 2


@pytest.fixture
def swapped(store):
    """The store with img_000002's leaf pointing at img_000003's value pages (lmdb sees nothing wrong)."""
    data = bytearray((store / "data.mdb").read_bytes())
    target = struct.unpack_from("<Q", data, leaf_pointer(data, "img_000003"))[0]
    struct.pack_into("<Q", data, leaf_pointer(data, "img_000002"), target)
    (store / "data.mdb").write_bytes(bytes(data))
    return store


WRONG = "the value stored under 'img_000002' is the record of 'img_000003'"


@pytest.mark.parametrize("how", ["getitem", "get", "read_batch", "view"])
def test_a_value_of_another_record_is_refused_naming_both(swapped, how):
    reader = FeatureReader(swapped)
    with pytest.raises(StoreDamagedError, match=WRONG) as err:
        if how == "getitem":
            reader["img_000002"]
        elif how == "get":
            reader.get("img_000002")
        elif how == "read_batch":
            reader.read_batch(["img_000001", "img_000002"])
        else:
            with reader.view() as view:
                view["img_000002"]
    assert f"xmodal features verify {swapped}" in str(err.value)
    assert reader["img_000003"].img_id == "img_000003"
    assert reader.read_batch(["img_000001", "img_000003"]).features.shape[0] == 2


def test_reads_are_requested_ahead_only_while_they_wait_for_the_disk(store, calls, in_memory, monkeypatch):
    """A warm store pays no request per value: once every value a read asks for is in memory, reads are
    not requested until one waits for the disk (a major page fault)."""
    cold = [0]  # while 1, every decode counts as a read that waited for the disk
    monkeypatch.setattr(
        storage.reader, "major_faults", lambda: cold[0] * sum(kind == "decode" for kind, _ in calls)
    )
    reader = FeatureReader(store)
    kinds = []
    for batch, (found, waits) in enumerate([(False, 0), (True, 0), (True, 1), (False, 0), (False, 0)]):
        in_memory[0], cold[0] = found, waits
        calls.clear()
        reader.read_batch([f"img_{batch:06d}", f"img_{batch + 1:06d}"])
        kinds.append(calls[0][0])
    # requested while not in memory; not once found there, even when a read then waits; requested again
    # after that
    assert kinds == ["request", "decode", "decode", "request", "request"]


def test_a_batch_asked_for_ahead_is_not_asked_for_again(store, calls, in_memory):
    """`request_ahead` asks for the next batch's values while this one is used; reading it later asks
    nothing more (and does not judge the store warm from pages the reader itself asked for), while ids
    not asked for ahead are requested with their read as before."""
    ahead, other = ["img_000006", "img_000002"], ["img_000004"]
    pages, all_pages = value_pages(store, ahead), value_pages(store, ahead + other)
    reader = FeatureReader(store)
    calls.clear()
    reader.request_ahead(ahead)
    assert [kind for kind, _ in calls] == ["request"]
    assert sorted(pages_of(calls[0][1])) == sorted(pages)
    calls.clear()
    in_memory[0] = True  # they have arrived: a probe now would take the store for warm
    reader.read_batch(ahead)
    assert [kind for kind, _ in calls] == ["decode", "decode"]
    in_memory[0] = False
    calls.clear()
    reader.read_batch(ahead + other)
    assert calls[0][0] == "request" and sorted(pages_of(calls[0][1])) == sorted(all_pages)
    # a warm store (the probe finds the values in memory before they are asked for) is asked for nothing
    in_memory[0] = True
    calls.clear()
    reader.request_ahead(other)
    reader.request_ahead(ahead)
    assert calls == []


def test_the_page_cache_probe(store):
    """The probe behind that, on the file alone (no reader maps it): evicted from the page cache the
    values are not in memory, read once they are."""
    import os
    from types import SimpleNamespace

    from storage.btree import walk_records
    from storage.metadata import RECORDS_DB

    walk = walk_records(store / "data.mdb", RECORDS_DB)
    spans = [walk.value_span(f"img_{i:06d}".encode()) for i in range(COUNT)]
    assert all(size for _, size in spans)
    fd = os.open(store / "data.mdb", os.O_RDONLY)
    try:
        shard = SimpleNamespace(probe=True, _fd=fd, _scratch=bytearray())
        os.fsync(fd)
        for _ in range(100):  # pages still in a CPU's batch of new pages escape one eviction
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if not storage.reader._Shard._in_memory(shard, spans):
                break
            time.sleep(0.01)
        assert not storage.reader._Shard._in_memory(shard, spans)
        os.pread(fd, os.path.getsize(store / "data.mdb"), 0)
        assert storage.reader._Shard._in_memory(shard, spans)
    finally:
        os.close(fd)


def test_membership_reads_no_value(store, monkeypatch):
    """`img_id in reader` (the trainer checks every id it will read) answers from the walk of the tree,
    without an lmdb lookup that would bring the whole value in from disk; a missing id still asks lmdb."""
    reader = FeatureReader(store)
    len(reader)
    looked_up = []
    lookup = storage.reader._Shard._lookup

    def recording(self, key, take):
        looked_up.append(key)
        return lookup(self, key, take)

    monkeypatch.setattr(storage.reader._Shard, "_lookup", recording)
    assert all(f"img_{i:06d}" in reader for i in range(COUNT))
    assert looked_up == []
    assert "img_999999" not in reader
    assert looked_up == [b"img_999999"]


def test_long_ranges_are_asked_for_in_pieces_the_kernel_reads_whole(monkeypatch):
    """Linux reads at most the read-ahead window (128 KB by default) of one WILLNEED call: a longer range
    (adjacent values merged) is asked for in pieces, which together cover it exactly."""
    asked = []
    monkeypatch.setattr(
        storage.reader.os, "posix_fadvise", lambda fd, at, size, advice: asked.append((at, size))
    )
    ranges = [(4096, 40 * PAGE), (1 << 20, 700 * 1024 + 8)]
    storage.reader.request_ranges(3, ranges)
    assert all(0 < size <= 128 * 1024 for _, size in asked)
    covered = sorted(asked)
    for (start, size), piece in zip(ranges, [covered[:2], covered[2:]], strict=True):
        assert piece[0][0] == start and sum(n for _, n in piece) == size
        assert all(a + n == b for (a, n), (b, _) in zip(piece, piece[1:], strict=False))
