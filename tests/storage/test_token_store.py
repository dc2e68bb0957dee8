"""The image-token store: grids round-trip, a reopened store resumes, damage is caught by the checksum,
and region and token readers refuse each other's stores by name."""

from __future__ import annotations

import numpy as np
import pytest

from storage import FeatureReader, FeatureWriter, RegionFeatures
from storage.errors import CorruptRecordError, StoreFormatError
from storage.token_store import TokenReader, TokenWriter, decode_tokens, encode_tokens


def test_grids_round_trip_and_reopen_resumes(tmp_path):
    rng = np.random.default_rng(0)
    grids = {f"img{i}": rng.integers(0, 700, (4, 4)) for i in range(5)}
    with TokenWriter(tmp_path / "s", grid=4, codebook_size=700, commit_every=2) as w:
        for k in ("img0", "img1", "img2"):
            assert w.put(k, grids[k])
    with TokenWriter(tmp_path / "s", grid=4, codebook_size=700) as w:
        assert "img1" in w and not w.put("img1", grids["img1"])
        for k in ("img3", "img4"):
            assert w.put(k, grids[k])
    r = TokenReader(tmp_path / "s")
    assert len(r) == 5 and sorted(r.keys()) == sorted(grids)
    for k, g in grids.items():
        np.testing.assert_array_equal(r[k], g)
    with pytest.raises(KeyError, match="nope"):
        r["nope"]
    r.close()


def test_reopen_with_other_shapes_is_refused(tmp_path):
    TokenWriter(tmp_path / "s", grid=4, codebook_size=10).close()
    with pytest.raises(StoreFormatError, match="new --out"):
        TokenWriter(tmp_path / "s", grid=8, codebook_size=10)


def test_out_of_range_tokens_are_refused(tmp_path):
    with TokenWriter(tmp_path / "s", grid=2, codebook_size=10) as w, pytest.raises(ValueError, match="a"):
        w.put("a", np.array([[0, 1], [2, 10]]))


def test_checksum_catches_a_flipped_byte(tmp_path):
    value = bytearray(encode_tokens("x", np.arange(4).reshape(2, 2)))
    np.testing.assert_array_equal(decode_tokens(bytes(value), "x", tmp_path), np.arange(4).reshape(2, 2))
    value[-1] ^= 1
    with pytest.raises(CorruptRecordError, match="checksum"):
        decode_tokens(bytes(value), "x", tmp_path)


def test_region_and_token_readers_refuse_each_other(tmp_path):
    TokenWriter(tmp_path / "tokens", grid=2, codebook_size=10).close()
    with pytest.raises(StoreFormatError, match="xmodal-image-tokens"):
        len(FeatureReader(tmp_path / "tokens"))  # the reader opens lazily
    region = RegionFeatures(
        img_id="r",
        img_h=10,
        img_w=10,
        objects_id=np.zeros(1, np.int64),
        objects_conf=np.ones(1, np.float32),
        attrs_id=np.zeros(1, np.int64),
        attrs_conf=np.ones(1, np.float32),
        boxes=np.array([[0, 0, 5, 5]], np.float32),
        features=np.zeros((1, 4), np.float16),
    )
    with FeatureWriter(tmp_path / "regions", feature_dim=4, max_boxes=2) as w:
        w.put(region)
    with pytest.raises(StoreFormatError, match="xmodal-region-features"):
        TokenReader(tmp_path / "regions")
