"""Images in: decoding to BGR uint8, detectron2's shortest-edge resize, normalisation and batch padding."""

from __future__ import annotations

import contextlib
import io
import os
import stat
import warnings
from collections.abc import Iterator
from pathlib import Path

import cv2
import numpy as np
import torch
from PIL import ExifTags, Image, ImageOps

from extraction.backbone import upload

MAX_PIXELS = 50_000_000
MAX_FILE_BYTES = 64 << 20  # a 50 MP JPEG is ~25 MB; bigger files are refused before they are read
# peak memory of load_resized per decoded pixel, measured at 49 MP (tests/benchmarks/bench_decode.py):
# WebP 16.0 (PIL's decoder holds RGBA twice), 16-bit PNG 12.0, RGB PNG 8.0, JPEG 11.9 at its reduced size
DECODE_BYTES_PER_PIXEL = 17
# Radiance HDR and PFM through OpenCV: float32 RGB (12 B/px) and the temporaries of rescaling it to uint8
OPENCV_BYTES_PER_PIXEL = 64
# the raster formats PIL may open, each decoded at the size its header states: not EPS (run through
# Ghostscript), ICO (an embedded PNG may be larger than its directory says), PSD, WMF or scientific formats
PIL_FORMATS = (
    "AVIF",
    "BMP",
    "DIB",
    "GIF",
    "JPEG",
    "JPEG2000",
    "PCX",
    "PNG",
    "PPM",
    "QOI",
    "SGI",
    "SUN",
    "TGA",
    "TIFF",
    "WEBP",
)


class ImageError(ValueError):
    """An image that cannot be used: names the file and the reason."""


def load_image(
    source: str | Path | bytes | np.ndarray,
    name: str | None = None,
    max_bytes: int = MAX_FILE_BYTES,
    max_pixels: int = MAX_PIXELS,
) -> np.ndarray:
    """Decode a file path, encoded bytes or an array into a BGR uint8 (H, W, 3) array.

    Handles grayscale, alpha (dropped), palette, 16-bit, CMYK and EXIF orientation; raises ImageError
    for empty, truncated, non-image or zero-pixel images, files over `max_bytes` and images over
    `max_pixels` (read from the header, before any pixel is decoded). Paths must name regular files
    (symlinks to them are fine): a FIFO, a device or a directory is refused at once, never read.
    """
    if isinstance(source, np.ndarray):
        return _from_array(source, name or "array", max_pixels)
    if isinstance(source, (bytes, bytearray)):
        label = name or "<bytes>"
        if len(source) > max_bytes:
            raise ImageError(_too_big(label, len(source), max_bytes))
        return _decode(bytes(source), label, max_pixels)
    path = Path(source)
    label = name or str(path)
    return _decode(_read_regular_file(path, label, max_bytes), label, max_pixels)


def _read_regular_file(path: Path, label: str, max_bytes: int) -> bytes:
    try:
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, forever
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise ImageError(
            f"image {label!r} cannot be read ({getattr(exc, 'strerror', None) or exc}); check the path"
        ) from exc
    info = os.fstat(fd)
    refusal = None
    if not stat.S_ISREG(info.st_mode):
        refusal = (
            f"image {label!r} is {_file_kind(info.st_mode)}, not a regular file; remove it from the input"
        )
    elif info.st_size > max_bytes:
        refusal = _too_big(label, info.st_size, max_bytes)
    if refusal is not None:
        os.close(fd)
        raise ImageError(refusal)
    with os.fdopen(fd, "rb", buffering=0) as f:
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise ImageError(f"image {label!r} cannot be read ({exc.strerror or exc})") from exc
    if len(data) > max_bytes:  # it grew while we looked
        raise ImageError(_too_big(label, len(data), max_bytes))
    return data


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _file_kind(mode: int) -> str:
    return next((kind for test, kind in _FILE_KINDS if test(mode)), "not a regular file")


def _too_big(label: str, size: int, max_bytes: int) -> str:
    return (
        f"image {label!r} is {size / 2**20:.1f} MiB, above the {max_bytes / 2**20:.0f} MiB file limit; "
        "downscale or re-encode it (or raise max_bytes)"
    )


def _decode(data: bytes, label: str, max_pixels: int) -> np.ndarray:
    img, _ = _load_pil(data, label, max_pixels)
    if img is None:
        return _decode_with_opencv(data, label, max_pixels)
    return _pil_to_bgr(img, label, max_pixels)


def _load_pil(
    data: bytes, label: str, max_pixels: int, working: tuple[int, int] | None = None
) -> tuple[Image.Image | None, tuple[int, int]]:
    """(the decoded upright image, the upright (h, w) its header states), or (None, (0, 0)) for formats
    PIL does not read. `working` = (min_size, max_size) decodes a JPEG at the smallest DCT scale (1/2,
    1/4, 1/8) that still holds the detector's working size."""
    img, size = _open_header(data, label, max_pixels, working)
    if img is None:
        return None, (0, 0)
    with _pil_errors(label):
        img.load()
    return ImageOps.exif_transpose(img), size


def _open_header(
    data: bytes, label: str, max_pixels: int, working: tuple[int, int] | None
) -> tuple[Image.Image | None, tuple[int, int]]:
    """(the image opened from its header, size checked and nothing decoded, a JPEG set to decode at the
    working size when `working` is given; the upright (h, w) the header states), or (None, (0, 0)) for
    formats PIL does not read."""
    if not data:
        raise ImageError(f"image {label!r} is an empty (0-byte) file; re-download or remove it")
    with _pil_errors(label):
        try:
            img = Image.open(io.BytesIO(data), formats=PIL_FORMATS)
        except Image.UnidentifiedImageError:
            return None, (0, 0)
        _check_size(img.width, img.height, label, max_pixels)  # from the header: nothing decoded yet
        size = _upright_size(img)
        if working is not None and img.format == "JPEG":
            h, w = resized_shape(*size, *working)
            img.draft(None, (h, w) if _is_transposed(img) else (w, h))
        return img, size


@contextlib.contextmanager
def _pil_errors(label: str) -> Iterator[None]:
    """PIL's refusals as one-line ImageErrors naming the image."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"image {label!r} is too large to decode ({exc})") from exc
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageError(
            f"image {label!r} is truncated or corrupt (PIL: {exc}); re-encode or remove it"
        ) from exc


def _is_transposed(img: Image.Image) -> bool:
    """Whether EXIF orientation swaps width and height (exif_transpose's rotations by 90 degrees)."""
    return img.getexif().get(ExifTags.Base.Orientation) in (5, 6, 7, 8)


def _upright_size(img: Image.Image) -> tuple[int, int]:
    return (img.width, img.height) if _is_transposed(img) else (img.height, img.width)


def load_resized(
    data: bytes,
    name: str,
    min_size: int,
    max_size: int,
    max_bytes: int = MAX_FILE_BYTES,
    max_pixels: int = MAX_PIXELS,
) -> tuple[np.ndarray, tuple[int, int]]:
    """Encoded bytes straight to the detector's working size: (BGR uint8 resized as `resize_image`
    would, the original upright (h, w)). Only the working-size image outlives the call.

    A JPEG is decoded at a reduced DCT scale that still holds the working size, then resized: close to,
    not bit for bit, resizing the full decode. Other formats are decoded in full, and their result is
    exactly `resize_image(load_image(data))`. Refusals are `load_image`'s.
    """
    if len(data) > max_bytes:
        raise ImageError(_too_big(name, len(data), max_bytes))
    img, size = _load_pil(data, name, max_pixels, (min_size, max_size))
    if img is None:
        bgr = _decode_with_opencv(data, name, max_pixels)
        return resize_image(bgr, min_size, max_size), bgr.shape[:2]
    new_h, new_w = resized_shape(*size, min_size, max_size)
    if img.mode in _WIDE_MODES:
        return resize_image(_pil_to_bgr(img, name, max_pixels), min_size, max_size), size
    img = _to_rgb(img)
    if img.size != (new_w, new_h):
        img = img.resize((new_w, new_h), Image.Resampling.BILINEAR)  # per channel: RGB or BGR alike
    return np.ascontiguousarray(np.asarray(img)[:, :, ::-1]), size


def decode_bytes(data: bytes, name: str, min_size: int, max_size: int, max_pixels: int = MAX_PIXELS) -> int:
    """The most memory `load_resized` holds at once for `data`, from its header alone (nothing is
    decoded); ImageError for the images `load_image` refuses on their header."""
    img, _ = _open_header(data, name, max_pixels, (min_size, max_size))
    if img is not None:
        return img.width * img.height * DECODE_BYTES_PER_PIXEL
    size = _opencv_header_size(data)
    if size is None:
        raise ImageError(f"{name!r} is not an image PIL or OpenCV can decode; remove it from the input")
    _check_size(*size, name, max_pixels)
    return size[0] * size[1] * OPENCV_BYTES_PER_PIXEL


def _decode_with_opencv(data: bytes, label: str, max_pixels: int) -> np.ndarray:
    """Formats PIL does not read (Radiance HDR, PFM) go to OpenCV, whose imdecode allocates the whole
    image before any check of ours: only formats whose header gives us the size first are passed on."""
    size = _opencv_header_size(data)
    if size is None:
        raise ImageError(f"{label!r} is not an image PIL or OpenCV can decode; remove it from the input")
    _check_size(*size, label, max_pixels)
    arr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    if arr is None:
        raise ImageError(f"image {label!r} is truncated or corrupt (OpenCV cannot decode it); remove it")
    return _from_array(arr, label, max_pixels)


def _opencv_header_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a Radiance HDR or PFM header, or None for any other content."""
    head = data[:4096]
    if head.startswith((b"#?RADIANCE", b"#?RGBE")):
        # header lines, an empty line, then the resolution line: "-Y 480 +X 640" (axes in either order)
        _, sep, rest = head.partition(b"\n\n")
        tokens = rest.split(b"\n", 1)[0].split() if sep else []
        if len(tokens) == 4 and {tokens[0][1:], tokens[2][1:]} == {b"X", b"Y"}:
            dims = {tokens[0][1:]: tokens[1], tokens[2][1:]: tokens[3]}
            if dims[b"X"].isdigit() and dims[b"Y"].isdigit():
                return int(dims[b"X"]), int(dims[b"Y"])
        return 0, 0  # an HDR file without a readable size: refused as having no pixels
    if head[:2] in (b"PF", b"Pf") and head[2:3].isspace():
        tokens = head[3:64].split()
        if len(tokens) >= 2 and tokens[0].isdigit() and tokens[1].isdigit():
            return int(tokens[0]), int(tokens[1])
        return 0, 0
    return None


def _check_size(width: int, height: int, label: str, max_pixels: int) -> None:
    if width <= 0 or height <= 0:
        raise ImageError(f"image {label!r} has no pixels ({width}x{height})")
    if width * height > max_pixels:
        raise ImageError(
            f"image {label!r} is {width}x{height} = {width * height / 1e6:.1f} MP, above the "
            f"{max_pixels / 1e6:.0f} MP limit; downscale it first"
        )


_WIDE_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")


def _pil_to_bgr(img: Image.Image, label: str, max_pixels: int) -> np.ndarray:
    if img.mode in _WIDE_MODES:
        # 16-bit grayscale: scale the full range to 8 bits (PIL's convert("RGB") would clip at 255)
        return _from_array(np.asarray(img), label, max_pixels)
    return np.ascontiguousarray(np.asarray(_to_rgb(img))[:, :, ::-1])


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode == "P":
        img = img.convert("RGBA")
    return img if img.mode == "RGB" else img.convert("RGB")


def _from_array(arr: np.ndarray, label: str, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """Arrays are taken as OpenCV lays them out: gray, BGR or BGRA; 16-bit and float are rescaled."""
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] not in (3, 4)):
        raise ImageError(f"image {label!r} has shape {arr.shape}; expected (H, W), (H, W, 3) or (H, W, 4)")
    _check_size(arr.shape[1], arr.shape[0], label, max_pixels)
    arr = _to_uint8(arr, label)
    if arr.ndim == 2:
        arr = cv2.cvtColor(arr, cv2.COLOR_GRAY2BGR)
    elif arr.shape[2] == 4:
        arr = arr[:, :, :3]
    return np.ascontiguousarray(arr)


def _to_uint8(arr: np.ndarray, label: str) -> np.ndarray:
    if arr.dtype == np.uint8:
        return arr
    if arr.dtype.kind in "iu":
        if arr.size and (arr.min() < 0 or arr.max() > 65535):
            raise ImageError(f"image {label!r} has {arr.dtype} values outside 0..65535")
        return ((arr.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8)
    if arr.dtype.kind == "f":
        if not np.isfinite(arr).all():
            raise ImageError(f"image {label!r} has non-finite float pixels")
        return (np.clip(arr, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
    raise ImageError(f"image {label!r} has unsupported pixel type {arr.dtype}")


def resized_shape(h: int, w: int, min_size: int, max_size: int) -> tuple[int, int]:
    """detectron2 ResizeShortestEdge.get_output_shape: shortest side to min_size, longest <= max_size."""
    size = float(min_size)
    scale = size / min(h, w)
    if h < w:
        newh, neww = size, scale * w
    else:
        newh, neww = scale * h, size
    if max(newh, neww) > max_size:
        scale = max_size * 1.0 / max(newh, neww)
        newh = newh * scale
        neww = neww * scale
    return int(newh + 0.5), int(neww + 0.5)


def resize_image(bgr: np.ndarray, min_size: int, max_size: int) -> np.ndarray:
    """Resize like detectron2's ResizeTransform on uint8: PIL bilinear."""
    h, w = bgr.shape[:2]
    new_h, new_w = resized_shape(h, w, min_size, max_size)
    if (new_h, new_w) == (h, w):
        return bgr
    pil = Image.fromarray(bgr).resize((new_w, new_h), Image.Resampling.BILINEAR)
    return np.asarray(pil)


def batch_images(
    images: list[np.ndarray],
    pixel_mean: tuple[float, float, float],
    pixel_std: tuple[float, float, float],
    device: torch.device,
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Normalise each resized BGR image, then zero-pad all to a common size: (N, 3, H, W) and sizes."""
    mean = torch.tensor(pixel_mean, dtype=torch.float32, device=device).view(3, 1, 1)
    std = torch.tensor(pixel_std, dtype=torch.float32, device=device).view(3, 1, 1)
    sizes = [(int(im.shape[0]), int(im.shape[1])) for im in images]
    height, width = max(s[0] for s in sizes), max(s[1] for s in sizes)
    batch = torch.zeros((len(images), 3, height, width), dtype=torch.float32, device=device)
    for i, im in enumerate(images):
        x = torch.from_numpy(np.ascontiguousarray(im.transpose(2, 0, 1)))
        if device.type == "cuda":
            # uint8 through pinned memory: a quarter of float32's bytes, copied without blocking the host
            x = x.pin_memory().to(device, non_blocking=True)
        x = x.to(device, torch.float32)
        batch[i, :, : im.shape[0], : im.shape[1]] = (x - mean) / std
    return batch, sizes


def canvas_batch(
    images: list[np.ndarray],
    slots: int,
    canvas_hw: tuple[int, int],
    pixel_mean: torch.Tensor,
    pixel_std: torch.Tensor,
) -> torch.Tensor:
    """Resized BGR images in the top-left corners of `slots` canvases (blank ones after them), normalised
    as `batch_images` does and zero beyond each image: (slots, 3, H, W) on the device of the (3, 1, 1)
    mean and std buffers, from one upload of uint8 pixels and one of the images' extents."""
    h, w = canvas_hw
    pixels = np.zeros((slots, 3, h, w), np.uint8)
    inside = np.zeros((slots, 1, h, w), bool)
    for slot, im in enumerate(images):
        pixels[slot, :, : im.shape[0], : im.shape[1]] = im.transpose(2, 0, 1)
        inside[slot, :, : im.shape[0], : im.shape[1]] = True
    device = pixel_mean.device
    x = upload(torch.from_numpy(pixels), device)
    inside_t = upload(torch.from_numpy(inside), device)
    return torch.where(inside_t, (x.to(torch.float32) - pixel_mean) / pixel_std, 0.0)
