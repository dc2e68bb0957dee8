"""Image decoding (every kind a folder of images holds), detectron2's resize arithmetic, batch padding."""

from __future__ import annotations

import io
import os
import re
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

from extraction import ImageError, load_image
from extraction.preprocess import MAX_FILE_BYTES, MAX_PIXELS, batch_images, resize_image, resized_shape


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


# Hostile files: each is refused with a clear ImageError well under a second, before any large
# allocation and without reading from anything but a regular file.


def refused(path, match: str, **kw) -> float:
    """Seconds load_image took to refuse `path`; a thread guards against a hang failing silently."""
    outcome: dict = {}

    def attempt():
        start = time.perf_counter()
        try:
            load_image(path, **kw)
        except ImageError as exc:
            outcome["error"] = str(exc)
        outcome["seconds"] = time.perf_counter() - start

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), f"load_image({path}) hung"
    assert re.search(match, outcome.get("error", "")), outcome
    return outcome["seconds"]


def png_header(width: int, height: int, depth: int = 16, colour: int = 6) -> bytes:
    """A valid PNG signature and IHDR claiming `width` x `height`, with a token IDAT."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0)
    idat = zlib.compress(bytes(4096))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def hdr_header(width: int, height: int, payload: int = 4096) -> bytes:
    return b"#?RADIANCE\nFORMAT=32-bit_rle_rgbe\n\n-Y %d +X %d\n" % (height, width) + bytes(payload)


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    os.mkfifo(tmp_path / "pipe.jpg")
    assert refused(tmp_path / "pipe.jpg", r"pipe.jpg.*named pipe \(FIFO\), not a regular file") < 1


def test_a_symlink_to_dev_zero_is_refused_unread(tmp_path):
    (tmp_path / "zero.jpg").symlink_to("/dev/zero")
    assert refused(tmp_path / "zero.jpg", r"zero.jpg.*character device, not a regular file") < 1


def test_a_directory_is_refused(tmp_path):
    (tmp_path / "album.jpg").mkdir()
    assert refused(tmp_path / "album.jpg", r"album.jpg.*a directory, not a regular file") < 1


def test_a_path_with_a_nul_byte(tmp_path):
    with pytest.raises(ImageError, match="cannot be read .embedded null byte"):
        load_image(str(tmp_path / "a\x00b.jpg"))


def test_a_symlink_to_a_regular_image_is_read(tmp_path, rgb):
    save(Image.fromarray(rgb), tmp_path / "a.png")
    (tmp_path / "link.png").symlink_to(tmp_path / "a.png")
    np.testing.assert_array_equal(load_image(tmp_path / "link.png"), rgb[:, :, ::-1])


def test_files_over_the_size_cap_are_refused_before_reading(tmp_path):
    assert MAX_FILE_BYTES == 64 << 20
    with open(tmp_path / "huge.jpg", "wb") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB on paper, nothing on disk
    assert refused(tmp_path / "huge.jpg", r"huge.jpg.*1024.0 MiB, above the 64 MiB file limit") < 1
    path = save(Image.new("RGB", (64, 64)), tmp_path / "small.png")
    refused(path, r"small.png.*above the 0 MiB file limit", max_bytes=64)
    with pytest.raises(ImageError, match="<bytes>.*file limit"):
        load_image(path.read_bytes(), max_bytes=64)


@pytest.mark.parametrize(
    "name, data",
    [
        ("big16.png", png_header(8000, 8000)),  # 16-bit RGBA: 512 MB once decoded
        ("hdr.jpg", hdr_header(8000, 8000)),  # Radiance HDR named .jpg: PIL passes it to OpenCV
    ],
)
def test_huge_sizes_are_refused_from_the_header(tmp_path, name, data):
    (tmp_path / name).write_bytes(data)
    assert refused(tmp_path / name, rf"{name}.*8000x8000 = 64.0 MP, above the 50 MP limit") < 1


@pytest.mark.slow
def test_header_checks_allocate_nothing_large(tmp_path):
    """In a fresh process, refusing both 8000 x 8000 files raises the peak RSS by under 64 MB."""
    (tmp_path / "a.png").write_bytes(png_header(8000, 8000))
    (tmp_path / "b.jpg").write_bytes(hdr_header(8000, 8000, payload=4 << 20))
    script = f"""
import resource
from extraction.preprocess import ImageError, load_image
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for name in ("a.png", "b.jpg"):
    try:
        load_image({str(tmp_path)!r} + "/" + name)
    except ImageError:
        pass
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) < 64 * 1024  # KiB


def test_a_small_hdr_still_decodes_through_opencv(tmp_path):
    values = np.linspace(0, 1, 6 * 10 * 3, dtype=np.float32).reshape(6, 10, 3)
    cv2.imwrite(str(tmp_path / "x.hdr"), values)
    out = load_image(tmp_path / "x.hdr")
    assert out.shape == (6, 10, 3) and out.dtype == np.uint8
    # RGBE keeps ~8 bits of mantissa: within a couple of levels of the exact conversion
    assert np.abs(out.astype(int) - np.round(values * 255).astype(int)).max() <= 2


def test_postscript_is_not_handed_to_ghostscript(tmp_path):
    (tmp_path / "x.eps").write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n")
    refused(tmp_path / "x.eps", "x.eps.*not an image")
