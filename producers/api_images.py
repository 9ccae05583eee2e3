"""Images submitted over HTTP: decoded, checked and stored before a task is accepted.

A task's image parts come as ``data:`` URLs (OpenAI's ``image_url`` parts); the API fetches no
URL. Each is decoded from base64 and checked by :func:`conveyor.images.check_image` (PNG, JPEG or
WebP, within the byte and pixel limits) off the event loop; one bad image refuses the request
with a 422 naming the part, and nothing of it is published. Good images go to the object store
by content, and the task carries their references.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from typing import Any

from fastapi import HTTPException

from conveyor.contracts import ImagePart
from conveyor.errors import RetryableError
from conveyor.images import ImageError, store_image
from conveyor.objectstore import ObjectStore
from producers.api_limits import MAX_ERRORS, error

_DATA_URL = re.compile(r"^data:image/(png|jpeg|jpg|webp);base64,", re.IGNORECASE)


def decode_data_url(url: str) -> bytes:
    """The bytes of a base64 ``data:image/...`` URL; ValueError naming what is wrong."""
    m = _DATA_URL.match(url)
    if m is None:
        if url.startswith(("http://", "https://")):
            raise ValueError("image URLs are not fetched: send the image as a data:image/...;base64, URL")
        raise ValueError("expected a data:image/png|jpeg|webp;base64, URL")
    try:
        return base64.b64decode(url[m.end() :], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the data URL's base64 does not decode") from None


def _image_urls(task: Any) -> list[tuple[list, str]]:
    """(location, url) of every image part of a validated ``TaskIn``, in order."""
    out = []
    for j, m in enumerate(task.messages or ()):
        if isinstance(m.content, list):
            for k, p in enumerate(m.content):
                if p.type == "image_url":
                    out.append((["messages", j, "content", k, "image_url", "url"], p.image_url.url))
    return out


def _check_and_store(urls: list[tuple[list, str]], store: ObjectStore) -> tuple[list[ImagePart], list[dict]]:
    parts, errors = [], []
    for loc, url in urls:
        try:
            parts.append(store_image(store, decode_data_url(url)))
        except (ValueError, ImageError) as exc:
            errors.append(error(loc, str(exc), "value_error"))
    return parts, errors


async def store_images(tasks: list[Any], store: ObjectStore | None, max_per_task: int) -> list[list[ImagePart]]:
    """Each task's image references, in part order; raises a 422 naming every bad image."""
    wanted = [_image_urls(t) for t in tasks]
    errors: list[dict] = []
    for i, urls in enumerate(wanted):
        if len(urls) > max_per_task:
            msg = f"{len(urls)} images exceed the limit of {max_per_task} (producer.max_images_per_task)"
            errors.append(error(["body", "tasks", i, "messages"], msg, "too_long"))
        elif urls and store is None:
            errors.append(error(["body", "tasks", i, "messages"], "this API keeps no images (no object store)", "value_error"))
    if errors:
        raise HTTPException(422, detail=errors[:MAX_ERRORS])
    if not any(wanted):
        return [[] for _ in tasks]
    located = [(["body", "tasks", i, *loc], url) for i, urls in enumerate(wanted) for loc, url in urls]
    assert store is not None
    # Decoding megabytes of images and the object store's round trips: off the event loop.
    try:
        parts, errors = await asyncio.to_thread(_check_and_store, located, store)
    except RetryableError:
        raise HTTPException(503, detail="the object store did not answer (storing images); retry") from None
    if errors:
        raise HTTPException(422, detail=errors[:MAX_ERRORS])
    it = iter(parts)
    return [[next(it) for _ in urls] for urls in wanted]
