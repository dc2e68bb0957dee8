"""Image decoding (every kind a folder of images holds), detectron2's resize arithmetic, batch padding."""

from __future__ import annotations

import io

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

from extraction import ImageError, load_image
from extraction.preprocess import MAX_PIXELS, batch_images, resize_image, resized_shape


@pytest.fixture()
def rgb() -> np.ndarray:
    rng = np.random.default_rng(0)
    img = np.zeros((24, 32, 3), np.uint8)
    img[:, :, 0] = 200  # red in RGB order
    img[:12, :, 1] = rng.integers(0, 255, size=(12, 32))
    return img


def save(img: Image.Image, path, **kw):
    img.save(path, **kw)
    return path


def test_rgb_png_becomes_bgr(tmp_path, rgb):
    out = load_image(save(Image.fromarray(rgb), tmp_path / "a.png"))
    assert out.dtype == np.uint8 and out.shape == (24, 32, 3)
    np.testing.assert_array_equal(out, rgb[:, :, ::-1])


def test_grayscale(tmp_path):
    gray = np.arange(24 * 32, dtype=np.uint8).reshape(24, 32)
    out = load_image(save(Image.fromarray(gray, "L"), tmp_path / "g.png"))
    assert out.shape == (24, 32, 3)
    for c in range(3):
        np.testing.assert_array_equal(out[:, :, c], gray)


def test_rgba_drops_alpha(tmp_path, rgb):
    rgba = np.dstack([rgb, np.full(rgb.shape[:2], 7, np.uint8)])
    out = load_image(save(Image.fromarray(rgba, "RGBA"), tmp_path / "a.png"))
    np.testing.assert_array_equal(out, rgb[:, :, ::-1])


def test_palette_with_transparency(tmp_path, rgb):
    pal = Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    pal.info["transparency"] = 0
    path = save(pal, tmp_path / "p.png", transparency=0)
    out = load_image(path)
    np.testing.assert_array_equal(
        out, np.asarray(Image.open(path).convert("RGBA").convert("RGB"))[:, :, ::-1]
    )


def test_16bit_grayscale_png_is_scaled_not_clipped(tmp_path):
    values = np.linspace(0, 65535, 24 * 32).astype(np.uint16).reshape(24, 32)
    path = tmp_path / "g16.png"
    cv2.imwrite(str(path), values)
    out = load_image(path)
    np.testing.assert_array_equal(out[:, :, 0], np.round(values / 257.0).astype(np.uint8))
    assert out.max() == 255 and out.min() == 0


def test_16bit_color_png(tmp_path):
    bgr16 = (np.random.default_rng(1).integers(0, 256, (24, 32, 3)) * 257).astype(np.uint16)
    path = tmp_path / "c16.png"
    cv2.imwrite(str(path), bgr16)
    np.testing.assert_array_equal(load_image(path), (bgr16 // 257).astype(np.uint8))


def test_cmyk_jpeg(tmp_path, rgb):
    path = save(Image.fromarray(rgb).convert("CMYK"), tmp_path / "c.jpg", quality=100)
    assert Image.open(path).mode == "CMYK"
    out = load_image(path).astype(int)
    assert np.abs(out - rgb[:, :, ::-1].astype(int)).mean() < 8


def test_exif_orientation_is_applied(tmp_path, rgb):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise for display
    path = save(Image.fromarray(rgb), tmp_path / "r.jpg", exif=exif, quality=100)
    out = load_image(path)
    assert out.shape == (32, 24, 3)
    stored = np.asarray(Image.open(path).convert("RGB"))[:, :, ::-1]  # pixels as stored, unrotated
    np.testing.assert_array_equal(out, np.rot90(stored, k=-1))


def test_truncated_jpeg_is_rejected_naming_the_file(tmp_path, rgb):
    buf = io.BytesIO()
    Image.fromarray(np.tile(rgb, (8, 8, 1))).save(buf, "JPEG")
    path = tmp_path / "cut.jpg"
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    with pytest.raises(ImageError, match="cut.jpg.*truncated"):
        load_image(path)


def test_zero_byte_file(tmp_path):
    path = tmp_path / "empty.jpg"
    path.write_bytes(b"")
    with pytest.raises(ImageError, match="empty.jpg.*0-byte"):
        load_image(path)


def test_non_image_file(tmp_path):
    path = tmp_path / "notes.jpg"
    path.write_text("this is not an image\n" * 10)
    with pytest.raises(ImageError, match="notes.jpg.*not an image"):
        load_image(path)


def test_missing_file(tmp_path):
    with pytest.raises(ImageError, match="nope.png.*cannot be read"):
        load_image(tmp_path / "nope.png")


def test_image_over_the_pixel_limit_is_rejected_before_decoding(tmp_path):
    side = int(np.sqrt(MAX_PIXELS)) + 100
    path = save(Image.new("1", (side, side)), tmp_path / "huge.png")
    with pytest.raises(ImageError, match="huge.png.*MP"):
        load_image(path)


def test_zero_pixel_array():
    with pytest.raises(ImageError, match="no pixels"):
        load_image(np.zeros((0, 10, 3), np.uint8), "blank")


def test_arrays_gray_bgra_uint16():
    gray = np.full((4, 5), 9, np.uint8)
    assert load_image(gray).shape == (4, 5, 3)
    bgra = np.dstack([np.full((4, 5, 3), 3, np.uint8), np.zeros((4, 5), np.uint8)])
    np.testing.assert_array_equal(load_image(bgra), np.full((4, 5, 3), 3, np.uint8))
    np.testing.assert_array_equal(load_image(np.full((4, 5, 3), 65535, np.uint16)), np.full((4, 5, 3), 255))
    with pytest.raises(ImageError, match="shape"):
        load_image(np.zeros((4, 5, 2), np.uint8), "odd")


def detectron2_output_shape(h, w, short, max_size):
    """ResizeShortestEdge.get_output_shape, restated: scale the short side, cap the long side, round."""
    scale = short / min(h, w)
    if max(h, w) * scale > max_size:
        scale = max_size / max(h, w)
    return int(h * scale + 0.5), int(w * scale + 0.5)


@pytest.mark.parametrize(
    ("h", "w"), [(480, 640), (640, 480), (500, 1500), (375, 500), (333, 500), (1, 1), (1000, 999), (427, 640)]
)
def test_resized_shape_matches_detectron2(h, w):
    assert resized_shape(h, w, 600, 1000) == detectron2_output_shape(h, w, 600, 1000)


def test_resized_shape_examples():
    assert resized_shape(480, 640, 600, 1000) == (600, 800)
    assert resized_shape(500, 1500, 600, 1000) == (333, 1000)
    assert resized_shape(375, 500, 600, 1000) == (600, 800)


def test_resize_uses_pil_bilinear_on_uint8():
    img = np.random.default_rng(2).integers(0, 256, (37, 53, 3), dtype=np.uint8)
    out = resize_image(img, 64, 96)
    assert out.shape == (64, 92, 3) and out.dtype == np.uint8
    expected = np.asarray(Image.fromarray(img).resize((92, 64), Image.Resampling.BILINEAR))
    np.testing.assert_array_equal(out, expected)


def test_batch_pads_with_zeros_after_normalisation():
    a = np.full((4, 6, 3), 100, np.uint8)
    b = np.full((5, 3, 3), 200, np.uint8)
    batch, sizes = batch_images([a, b], (100.0, 110.0, 120.0), (1.0, 1.0, 1.0), torch.device("cpu"))
    assert batch.shape == (2, 3, 5, 6) and sizes == [(4, 6), (5, 3)]
    assert torch.equal(batch[0, :, 4:], torch.zeros(3, 1, 6))
    assert torch.equal(batch[1, :, :, 3:], torch.zeros(3, 5, 3))
    assert torch.allclose(
        batch[0, :, :4, :6], torch.tensor([0.0, -10.0, -20.0]).view(3, 1, 1).expand(3, 4, 6)
    )
