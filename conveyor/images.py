"""Images in tasks: checked where they enter, stored once by content, read back verified.

Every image a task carries enters through :func:`store_image` (the HTTP API, the dataset
loaders, the visual suites): its bytes are decoded with Pillow and refused unless they are a
PNG, JPEG or WebP within the size limits; they go to the object store under their sha256
(``images/<sha[:2]>/<sha>.<ext>``) and the task holds an :class:`~conveyor.contracts.ImagePart`
reference. Kafka records and the lake carry that reference, never the pixels; the rollout
worker and the learner read the bytes with :func:`load_image`, which checks the digest.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from conveyor.contracts import ImagePart
from conveyor.keys import image_key
from conveyor.objectstore import sha256_hex

if TYPE_CHECKING:
    from PIL import Image as PILImage

    from conveyor.objectstore import ObjectStore

MAX_IMAGE_BYTES = 8 * 1024 * 1024
"""Largest encoded image accepted (8 MiB)."""
MAX_IMAGE_SIDE = 4096
MAX_IMAGE_PIXELS = 4096 * 4096
"""Largest decoded image: a small file can decode to gigabytes (a decompression bomb), so the
dimensions in the header are checked before any pixel is decoded."""
_FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}


PutImage = Callable[[bytes], ImagePart]
"""Checks an image's bytes and keeps them, returning the reference (``store_image`` bound to a
store, or an :class:`ImageKeeper`): what dataset loaders and suites that draw pictures are given."""


class ImageError(ValueError):
    """Bytes that are not an image Conveyor accepts; the message says why."""


@dataclass(frozen=True)
class ImageInfo:
    media_type: str
    width: int
    height: int


def check_image(data: bytes) -> ImageInfo:
    """The image's type and size, or :class:`ImageError` naming what is wrong with it."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageError("empty image")
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"image is {len(data)} bytes; the limit is {MAX_IMAGE_BYTES}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=list(_FORMATS))
            width, height = img.size
            if width > MAX_IMAGE_SIDE or height > MAX_IMAGE_SIDE or width * height > MAX_IMAGE_PIXELS:
                raise ImageError(
                    f"image is {width}x{height}; the limits are {MAX_IMAGE_SIDE} a side and {MAX_IMAGE_PIXELS} pixels"
                )
            img.load()  # decodes every pixel: a truncated or corrupt body fails here, not in a worker
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError("not a PNG, JPEG or WebP image") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"image does not decode: {exc}") from None
    if width < 1 or height < 1:
        raise ImageError(f"image is {width}x{height}")
    return ImageInfo(_FORMATS[str(img.format)], width, height)


def image_reference(data: bytes) -> ImagePart:
    """Check ``data``; the reference it would have once stored (``conveyor tasks validate``
    checks a file's images without storing them)."""
    info = check_image(data)
    sha = sha256_hex(data)
    key = image_key(sha, info.media_type)
    return ImagePart(key=key, sha256=sha, media_type=info.media_type, width=info.width, height=info.height)  # type: ignore[arg-type]


def store_image(store: ObjectStore, data: bytes) -> ImagePart:
    """Check ``data`` and store it once by content; the reference a task carries."""
    part = image_reference(data)
    store.put_if_absent(part.key, data, sha256=part.sha256)
    return part


class ImageKeeper:
    """``store_image`` into a store opened on the first image (a text-only dataset or suite never
    opens one), remembering what it stored: an image that many tasks or epochs share is put once."""

    def __init__(self, open_store: Callable[[], ObjectStore]) -> None:
        self._open = open_store
        self._store: ObjectStore | None = None
        self._seen: dict[str, ImagePart] = {}

    def __call__(self, data: bytes) -> ImagePart:
        sha = sha256_hex(data)
        part = self._seen.get(sha)
        if part is None:
            if self._store is None:
                self._store = self._open()
            part = self._seen[sha] = store_image(self._store, data)
        return part


def load_image(store: ObjectStore, part: ImagePart) -> PILImage.Image:
    """The image a reference names, as RGB, its bytes checked against the reference's digest
    (``ChecksumMismatch`` when they differ)."""
    from PIL import Image

    data = store.get(part.key, sha256=part.sha256)
    img = Image.open(io.BytesIO(data), formats=list(_FORMATS))
    img.load()
    return img.convert("RGB")


def encode_png(img: PILImage.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False)
    return buf.getvalue()
