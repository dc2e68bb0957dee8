"""Images in: decoding to BGR uint8, detectron2's shortest-edge resize, normalisation and batch padding."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import cv2
import numpy as np
import torch
from PIL import Image, ImageOps

MAX_PIXELS = 50_000_000


class ImageError(ValueError):
    """An image that cannot be used: names the file and the reason."""


def load_image(source: str | Path | bytes | np.ndarray, name: str | None = None) -> np.ndarray:
    """Decode a file path, encoded bytes or an array into a BGR uint8 (H, W, 3) array.

    Handles grayscale, alpha (dropped), palette, 16-bit, CMYK and EXIF orientation; raises ImageError
    for empty, truncated, non-image, zero-pixel or larger than 50 MP images.
    """
    if isinstance(source, np.ndarray):
        return _from_array(source, name or "array")
    if isinstance(source, (bytes, bytearray)):
        return _decode(bytes(source), name or "<bytes>")
    path = Path(source)
    label = name or str(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ImageError(f"image {label!r} cannot be read ({exc.strerror or exc}); check the path") from exc
    return _decode(data, label)


def _decode(data: bytes, label: str) -> np.ndarray:
    if not data:
        raise ImageError(f"image {label!r} is an empty (0-byte) file; re-download or remove it")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            _check_size(img.width, img.height, label)
            img.load()
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"image {label!r} is too large to decode ({exc})") from exc
    except Image.UnidentifiedImageError:
        return _decode_with_opencv(data, label)
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageError(
            f"image {label!r} is truncated or corrupt (PIL: {exc}); re-encode or remove it"
        ) from exc
    img = ImageOps.exif_transpose(img)
    return _pil_to_bgr(img, label)


def _decode_with_opencv(data: bytes, label: str) -> np.ndarray:
    """Formats PIL does not know (e.g. EXR, some TIFFs) still get a chance through OpenCV."""
    arr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    if arr is None:
        raise ImageError(f"{label!r} is not an image PIL or OpenCV can decode; remove it from the input")
    return _from_array(arr, label)


def _check_size(width: int, height: int, label: str) -> None:
    if width <= 0 or height <= 0:
        raise ImageError(f"image {label!r} has no pixels ({width}x{height})")
    if width * height > MAX_PIXELS:
        raise ImageError(
            f"image {label!r} is {width}x{height} = {width * height / 1e6:.1f} MP, above the "
            f"{MAX_PIXELS / 1e6:.0f} MP limit; downscale it first"
        )


def _pil_to_bgr(img: Image.Image, label: str) -> np.ndarray:
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        # 16-bit grayscale: scale the full range to 8 bits (PIL's convert("RGB") would clip at 255)
        return _from_array(np.asarray(img), label)
    if img.mode == "P":
        img = img.convert("RGBA")
    if img.mode != "RGB":
        img = img.convert("RGB")
    return np.ascontiguousarray(np.asarray(img)[:, :, ::-1])


def _from_array(arr: np.ndarray, label: str) -> np.ndarray:
    """Arrays are taken as OpenCV lays them out: gray, BGR or BGRA; 16-bit and float are rescaled."""
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] not in (3, 4)):
        raise ImageError(f"image {label!r} has shape {arr.shape}; expected (H, W), (H, W, 3) or (H, W, 4)")
    _check_size(arr.shape[1], arr.shape[0], label)
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
        x = torch.from_numpy(np.ascontiguousarray(im.transpose(2, 0, 1))).to(device, torch.float32)
        batch[i, :, : im.shape[0], : im.shape[1]] = (x - mean) / std
    return batch, sizes
