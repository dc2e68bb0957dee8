"""storage.contents: the metadata record is checked against records sampled across the store."""

from __future__ import annotations

from pathlib import Path

from storage.contents import SAMPLES, contents_lie, sample_keys


def test_samples_span_the_store():
    keys = [f"k{i:05d}".encode() for i in range(1000)]
    picked = sample_keys(keys)
    assert len(picked) == SAMPLES and picked[0] == keys[0] and picked[-1] == keys[-1]
    assert picked == sorted(set(picked))
    assert sample_keys(keys[:3]) == keys[:3]


def test_a_lie_in_a_record_only_the_last_sample_reaches(tmp_path, make_record):
    """Every sampled record is read, not only the first: a store whose last record disagrees is refused."""
    from storage import codec

    path = tmp_path / "s"
    meta = {"count": 40, "dtype": "float16", "feature_dim": 64, "max_boxes": 100}
    keys = [make_record(i).img_id.encode() for i in range(40)]
    values = {k: codec.encode(make_record(i)) for i, k in enumerate(keys)}
    assert contents_lie(Path(path), meta, keys, values.get) is None
    values[keys[-1]] = codec.encode(make_record(39), dtype="float32")
    line = contents_lie(Path(path), meta, keys, values.get)
    assert f"record {keys[-1].decode()!r} holds float32 features" in line and "\n" not in line
