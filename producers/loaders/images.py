"""A record's images as references in its chat: the layouts datasets keep images in.

- **veRL multimodal parquet:** an ``images`` column (a list of ``{"bytes", "path"}``) and
  ``<image>`` markers in the prompt's message text, one per image, in order.
- **Hugging Face datasets' ``Image`` feature:** ``{"bytes": ..., "path": ...}`` (bytes may be
  null when the path names a file), one image or a list of them; chat content in the
  processor's part layout, ``[{"type": "image"}, {"type": "text", "text": ...}]``, where each
  ``{"type": "image"}`` takes the next image of the column.
- **OpenAI's chat layout:** ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``.

An image column with no marker anywhere puts its images at the head of the first user message
(single-image question answering, e.g. ``{"image": ..., "question": ...}``). Every image is
checked and stored by :func:`conveyor.images.store_image`; a record whose images do not decode,
or whose markers and images do not pair up, is refused naming the field.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from conveyor.contracts import IMAGE_PLACEHOLDER, ContentPart, ImagePart, TextPart
from conveyor.images import ImageError, PutImage
from producers.loaders.errors import FieldError


class RecordImages:
    """The images one record brings, handed out in order as its markers ask for them."""

    def __init__(self, values: list[Any], field: str, put: PutImage | None, base_dir: Path | None) -> None:
        self.values, self.field, self.put, self.base_dir = values, field, put, base_dir
        self.used = 0

    def take(self, where: str) -> ImagePart:
        if self.used >= len(self.values):
            raise FieldError(where, f"an image marker with no image left in {self.field} ({len(self.values)} given)")
        part = self.reference(self.values[self.used], f"{self.field}[{self.used}]")
        self.used += 1
        return part

    def reference(self, value: Any, where: str) -> ImagePart:
        if self.put is None:
            raise FieldError(where, "the record has images but this loader was given no object store to keep them in")
        data = image_bytes(value, where, self.base_dir)
        try:
            return self.put(data)
        except ImageError as exc:
            raise FieldError(where, str(exc)) from None

    def check_all_used(self) -> None:
        if self.used and self.used != len(self.values):
            raise FieldError(self.field, f"{len(self.values)} images but {self.used} image markers in the prompt")


def record_images(value: Any, field: str, put: PutImage | None, base_dir: Path | None) -> RecordImages:
    if isinstance(value, (dict, bytes, str)):
        value = [value]
    if not isinstance(value, list):
        raise FieldError(field, f"expected an image or a list of images, got {type(value).__name__}")
    return RecordImages(value, field, put, base_dir)


def image_bytes(value: Any, where: str, base_dir: Path | None) -> bytes:
    """The encoded bytes of one image as a dataset holds it."""
    if isinstance(value, dict):
        if value.get("bytes"):
            value = value["bytes"]
        elif value.get("path"):
            value = value["path"]
        elif isinstance(value.get("url"), str):
            value = value["url"]
        else:
            raise FieldError(where, "an image object with neither bytes nor path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if not isinstance(value, str):
        raise FieldError(where, f"expected image bytes, a path or a data URL, got {type(value).__name__}")
    if value.startswith("data:"):
        head, _, body = value.partition(",")
        if ";base64" not in head:
            raise FieldError(where, "a data URL that is not base64")
        try:
            return base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise FieldError(where, "a data URL whose base64 does not decode") from None
    if "://" in value:
        raise FieldError(where, f"image URLs are not fetched ({value[:60]}): give the bytes or a local path")
    path = Path(value)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        return path.read_bytes()
    except OSError as exc:
        raise FieldError(where, f"cannot read image {value}: {exc.strerror}") from None


def split_markers(text: str, images: RecordImages, where: str) -> Iterator[ContentPart]:
    """Text with ``<image>`` markers as parts, each marker taking the record's next image."""
    pieces = text.split(IMAGE_PLACEHOLDER)
    for i, piece in enumerate(pieces):
        if i:
            yield images.take(where)
        if piece:
            yield TextPart(text=piece)


def content_parts(content: Any, images: RecordImages, where: str) -> str | list[ContentPart]:
    """A message's content with its images resolved: text stays text when it has no marker."""
    if isinstance(content, str):
        if IMAGE_PLACEHOLDER not in content or not images.values:
            return content
        return list(split_markers(content, images, where))
    if not isinstance(content, list):
        raise FieldError(where, f"expected text or a list of content parts, got {type(content).__name__}")
    out: list[ContentPart] = []
    for i, part in enumerate(content):
        at = f"{where}[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise FieldError(f"{at}.text", "expected text")
            out.extend(split_markers(text, images, at) if images.values else [TextPart(text=text)])
        elif kind == "image":
            inline = part.get("image")
            out.append(images.reference(inline, f"{at}.image") if inline is not None else images.take(at))
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            out.append(images.reference(url, f"{at}.image_url"))
        else:
            raise FieldError(at, f"expected a part of type text, image or image_url, got {kind!r}")
    if not out:
        raise FieldError(where, "empty list of content parts")
    return out


def lead_with_images(parts: str | list[ContentPart], images: RecordImages, where: str) -> list[ContentPart]:
    """The record's unplaced images ahead of a message's content (no marker anywhere)."""
    head: list[ContentPart] = [images.take(where) for _ in range(len(images.values))]
    return head + ([TextPart(text=parts)] if isinstance(parts, str) else parts)
