"""Decoding straight to the detector's working size (`load_resized`, used by `serve`): the same pixels as
decoding in full then resizing, except JPEG's reduced DCT decoding, which comes close; `decode_bytes`
reads the cost from the header alone."""

from __future__ import annotations

import io

import cv2
import numpy as np
import pytest
from PIL import Image

from extraction import ImageError, load_image
from extraction.preprocess import DECODE_BYTES_PER_PIXEL, decode_bytes, load_resized, resize_image

WORKING = (600, 1000)


def smooth_rgb(h: int, w: int, seed: int = 0) -> np.ndarray:
    small = np.random.default_rng(seed).integers(0, 256, size=(h // 16, w // 16, 3), dtype=np.uint8)
    return cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)


def encode(img: Image.Image, fmt: str, **kwargs) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **kwargs)
    return out.getvalue()


def rotated_exif() -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = 6  # displayed rotated by 90 degrees: width and height swap
    return exif


CASES = {
    "png": lambda rgb: encode(Image.fromarray(rgb), "PNG"),
    "webp": lambda rgb: encode(Image.fromarray(rgb), "WEBP", lossless=True),
    "rgba png": lambda rgb: encode(Image.fromarray(rgb).convert("RGBA"), "PNG"),
    "palette png": lambda rgb: encode(Image.fromarray(rgb).quantize(64), "PNG"),
    "16-bit png": lambda rgb: encode(Image.fromarray(rgb[:, :, 0].astype(np.uint16) * 257), "PNG"),
    "rotated png": lambda rgb: encode(Image.fromarray(rgb), "PNG", exif=rotated_exif()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_other_formats_equal_the_full_decode_resized(case):
    data = CASES[case](smooth_rgb(1200, 1700))
    full = load_image(data)
    got, size = load_resized(data, case, *WORKING)
    assert size == full.shape[:2]
    np.testing.assert_array_equal(got, resize_image(full, *WORKING))


@pytest.mark.parametrize("rotated", [False, True])
def test_jpeg_decodes_reduced_and_comes_close(rotated):
    extra = {"exif": rotated_exif()} if rotated else {}
    data = encode(Image.fromarray(smooth_rgb(2400, 3200)), "JPEG", quality=95, **extra)
    full = load_image(data)
    want = resize_image(full, *WORKING)
    got, size = load_resized(data, "big.jpg", *WORKING)
    assert size == full.shape[:2] == ((3200, 2400) if rotated else (2400, 3200))
    assert got.shape == want.shape
    assert np.abs(got.astype(int) - want.astype(int)).mean() < 2.0  # of 255: the DCT scaling differs
    # decoded at 1/4, the working size itself (800 x 600), not at 3200 x 2400
    assert decode_bytes(data, "big.jpg", *WORKING) == 800 * 600 * DECODE_BYTES_PER_PIXEL


def test_the_cost_comes_from_the_header_before_any_pixel():
    data = encode(Image.new("RGB", (7000, 7000), (10, 20, 30)), "WEBP", lossless=True)
    assert len(data) < 5000  # near the 50 MP limit, a few KB on the wire
    assert decode_bytes(data, "flat.webp", *WORKING) == 7000 * 7000 * DECODE_BYTES_PER_PIXEL


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (b"not an image at all", "not an image"),
        (encode(Image.new("L", (8000, 8000)), "PNG"), "above the 50 MP limit"),
    ],
)
def test_refusals_are_load_images(data, message):
    with pytest.raises(ImageError, match=message):
        decode_bytes(data, "x", *WORKING)
    with pytest.raises(ImageError, match=message):
        load_resized(data, "x", *WORKING)
