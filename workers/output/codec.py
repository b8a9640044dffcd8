"""Image encoding: a pipeline output -> PNG/WebP/JPEG bytes, deterministically.

Same pixels + same format and settings + same provenance + same Pillow build -> the same bytes:
no timestamps, no ICC profile, no encoder metadata. The only metadata is the image's provenance
when one is given (workers.output.provenance: PNG text chunks, EXIF and XMP for JPEG and WebP),
itself a pure function of the row's settings and the job; without one, no EXIF, XMP or text
chunk. The float -> uint8 conversion is diffusers' (`(x * 255).round()` after clamping to
[0, 1]), so images match its output.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any

import numpy as np
from PIL import Image

from ditfleet.workers.output.layout import IMAGE_EXTENSIONS
from ditfleet.workers.output.provenance import Provenance

CONTENT_TYPES = {"png": "image/png", "webp": "image/webp", "jpeg": "image/jpeg"}
assert CONTENT_TYPES.keys() == IMAGE_EXTENSIONS.keys(), "an image format needs an extension and a MIME type"
DEFAULT_QUALITY = {"webp": 90, "jpeg": 95}
# A JPEG APP1 segment holds at most this many bytes (its length field is 16 bits and counts
# itself); Pillow refuses longer EXIF or XMP (the XMP less its 29-byte namespace header).
_JPEG_SEGMENT = 65533


class ImageEncodeError(ValueError):
    """This image cannot be encoded (non-finite values, wrong shape); fails the row, not the shard."""


def extension(fmt: str) -> str:
    return IMAGE_EXTENSIONS[_check_format(fmt)]


def content_type(fmt: str) -> str:
    return CONTENT_TYPES[_check_format(fmt)]


def _check_format(fmt: str) -> str:
    if fmt not in IMAGE_EXTENSIONS:
        raise ValueError(f"image format {fmt!r} is not one of {sorted(IMAGE_EXTENSIONS)}")
    return fmt


def to_uint8_hwc(image: Any) -> np.ndarray:
    """(3, H, W) float tensor/array in [0, 1] or (H, W, 3) uint8 array -> (H, W, 3) uint8 array."""
    if hasattr(image, "detach"):  # torch.Tensor, without importing torch here
        tensor = image.detach()
        if tensor.dim() != 3 or tensor.shape[0] != 3:
            raise ImageEncodeError(f"expected a (3, H, W) image tensor, got shape {tuple(tensor.shape)}")
        tensor = tensor.float()  # bf16 * 255 would round before .round() does
        if not bool(tensor.isfinite().all()):
            raise ImageEncodeError("image has non-finite values (NaN or Inf) in the generated output")
        # Quantise where the tensor lives (a GPU moves 4x fewer bytes to the host as uint8).
        tensor = (tensor.clamp(0.0, 1.0) * 255.0).round().byte()
        return np.ascontiguousarray(tensor.permute(1, 2, 0).cpu().numpy())
    array = np.asarray(image)
    if array.dtype == np.uint8:
        if array.ndim != 3 or array.shape[2] != 3:
            raise ImageEncodeError(f"expected an (H, W, 3) uint8 array, got shape {array.shape}")
        return np.ascontiguousarray(array)
    if np.issubdtype(array.dtype, np.floating):
        if array.ndim != 3 or array.shape[0] != 3:
            raise ImageEncodeError(f"expected a (3, H, W) float array, got shape {array.shape}")
        array = array.astype(np.float32)
        if not np.isfinite(array).all():
            raise ImageEncodeError("image has non-finite values (NaN or Inf) in the generated output")
        array = (np.clip(array, 0.0, 1.0) * 255.0).round().astype(np.uint8)
        return np.ascontiguousarray(array.transpose(1, 2, 0))
    raise ImageEncodeError(f"cannot encode an image of dtype {array.dtype}")


def to_pil(images: Any) -> list[Image.Image]:
    """Pipeline output as PIL images: (B, 3, H, W) or (3, H, W) in [0, 1] -> one RGB image each,
    the pixels a job stores (the conversion above)."""
    batch = images if len(images.shape) == 4 else images[None]
    return [Image.fromarray(to_uint8_hwc(image), "RGB") for image in batch]


def encode_image(
    image: Any,
    fmt: str = "png",
    quality: int | None = None,
    png_compress_level: int = 6,
    provenance: Provenance | None = None,
) -> bytes:
    """Encode one image. `image`: (3, H, W) float in [0, 1] (torch or numpy) or (H, W, 3) uint8.

    `quality` (1-100) applies to webp and jpeg; `png_compress_level` (0-9) trades PNG size for
    encode time (1 is several times faster than 6 for about 10-20% larger files).
    `provenance`: what the file's metadata says made it; None: no metadata at all.
    """
    _check_format(fmt)
    pixels = to_uint8_hwc(image)
    picture = Image.fromarray(pixels)
    buf = io.BytesIO()
    if fmt == "png":
        extra: dict[str, Any] = {} if provenance is None else {"pnginfo": provenance.png_info()}
        picture.save(buf, format="PNG", compress_level=png_compress_level, optimize=False, **extra)
    else:
        q = DEFAULT_QUALITY[fmt] if quality is None else quality
        if not 1 <= q <= 100:
            raise ValueError(f"{fmt} quality must be in 1..100, got {q}")
        extra = {} if provenance is None else _exif_and_xmp(provenance, fmt)
        if fmt == "webp":
            picture.save(buf, format="WEBP", quality=q, method=4, exact=False, **extra)
        else:
            picture.save(buf, format="JPEG", quality=q, optimize=False, progressive=False, **extra)
    return buf.getvalue()


def _exif_and_xmp(provenance: Provenance, fmt: str) -> dict[str, bytes]:
    """Pillow's `exif` and `xmp` arguments for a WebP or JPEG. A JPEG segment holds 64 KiB: where
    a block is longer (prompts of many thousand characters), it goes without its duplicate of
    the parameters text (EXIF ImageDescription, XMP dc:description), and if that is still too
    long, without the block, so that a long prompt never fails the image."""
    if fmt == "webp":  # RIFF chunks have no such limit
        return {"exif": provenance.exif(), "xmp": provenance.xmp()}
    out: dict[str, bytes] = {}
    exif = next((b for b in (provenance.exif(), provenance.exif(False)) if len(b) <= _JPEG_SEGMENT), None)
    if exif is not None:
        out["exif"] = exif
    xmp = next((b for b in (provenance.xmp(), provenance.xmp(False)) if len(b) <= _JPEG_SEGMENT - 29), None)
    if xmp is not None:
        out["xmp"] = xmp
    return out


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
