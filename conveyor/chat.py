"""Chat messages as tasks carry them: text, or parts of text and images by reference.

Part of the message contracts (``conveyor/contracts.py`` re-exports every name here): a
``ChatMessage``'s content is a string, or a list of ``TextPart`` and ``ImagePart``. An image
travels as a reference to its bytes in the object store (``conveyor/images.py``), never inline.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from conveyor.keys import image_key


class TextPart(msgspec.Struct, frozen=True, gc=False, kw_only=True, tag_field="type", tag="text"):
    text: str


class ImagePart(msgspec.Struct, frozen=True, gc=False, kw_only=True, tag_field="type", tag="image"):
    """An image by reference (the claim-check path): its bytes live in the object store under
    ``key`` (content-addressed, ``conveyor.keys.image_key``) and are checked against ``sha256``
    when read. Records stay small whatever the image's size, and the lake stores the reference."""

    key: str
    sha256: str
    media_type: Literal["image/png", "image/jpeg", "image/webp"]
    width: int
    height: int

    def __post_init__(self) -> None:
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError("ImagePart.sha256 must be 64 lowercase hex digits")
        if self.width < 1 or self.height < 1:
            raise ValueError("ImagePart width and height must be positive")
        if self.key != image_key(self.sha256, self.media_type):
            # the key is the content's: a reference cannot point a worker at another object of the store
            raise ValueError(f"ImagePart.key {self.key[:80]!r} is not the key of its sha256 and type")


ContentPart = TextPart | ImagePart
IMAGE_PLACEHOLDER = "<image>"
"""How an image shows in text-only views of a chat (judges, logs): the veRL layout's marker."""


class ChatMessage(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One chat turn. ``content`` is text, or a list of parts (text and images) for
    vision-language tasks; a message with images makes its task schema version 2."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ContentPart]
    name: str | None = None  # tool name for role == "tool"

    def __post_init__(self) -> None:
        if isinstance(self.content, list) and not self.content:
            raise ValueError("ChatMessage.content is an empty list of parts")

    @property
    def text(self) -> str:
        """The text of the message, each image shown as ``<image>``."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if isinstance(p, TextPart) else IMAGE_PLACEHOLDER for p in self.content)

    @property
    def images(self) -> list[ImagePart]:
        if isinstance(self.content, str):
            return []
        return [p for p in self.content if isinstance(p, ImagePart)]


def task_images(messages: list[ChatMessage] | None) -> list[ImagePart]:
    """Every image of a chat, in order."""
    return [img for m in messages or () for img in m.images]
