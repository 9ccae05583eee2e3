"""Which host directories a task may name as its workspace's image.

A terminal task's ``verifier.data.image`` names a directory on the reward
worker that the sandboxed program sees (read-only, under its own writes) as
``/workspace``. Tasks come from users and files, so the name is untrusted:
``"/etc"`` would show the host's ``/etc`` to the model's program. An image is
accepted only when its real path (every symlink and ``..`` resolved, as
``os.path.realpath`` does) lies inside one of the operator's allow-listed
roots (``reward.image_roots``); with none, no image is accepted. The name
must be absolute and without ``..`` (as the producer's API requires of a
submitted one, ``producer.image_roots``). The resolved path is what the
caller mounts or copies, so a symlink in the name cannot be re-pointed between
the check and the use; the image's own contents are the operator's to keep
safe (a symlink inside it resolves in the sandbox's view, not the host's).

Usage::

    base = resolve_image(task.verifier.data["image"], sandbox.image_roots)  # raises ImageNotAllowed
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

FIELD = "verifier.data.image"


class ImageNotAllowed(ValueError):
    """The task names an image outside the allowed roots, or one that is not a directory."""


def normalise_roots(roots: Sequence[str | os.PathLike]) -> tuple[str, ...]:
    """The roots' real paths (a root that is itself a symlink counts as where it points)."""
    return tuple(os.path.realpath(r) for r in roots)


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def resolve_image(image: object, roots: Sequence[str]) -> Path:
    """The real directory ``image`` names, when it lies inside one of ``roots`` (real paths, as
    :func:`normalise_roots` makes them)."""
    allowed = ", ".join(roots)
    if not isinstance(image, str) or not image or "\0" in image:
        raise ImageNotAllowed(f"{FIELD} must be a directory path, not {image!r}")
    if not roots:
        raise ImageNotAllowed(f"{FIELD} {image!r} is not allowed: no host image directories here (reward.image_roots is empty)")
    if not os.path.isabs(image) or ".." in image.split("/"):
        raise ImageNotAllowed(
            f"{FIELD} {image!r} is not allowed: it must be an absolute path without '..' inside reward.image_roots ({allowed})"
        )
    real = os.path.realpath(image)
    if any(_inside(real, r) for r in roots):
        if not os.path.isdir(real):
            raise ImageNotAllowed(f"{FIELD} {image!r} is not a directory on this worker")
        return Path(real)
    raise ImageNotAllowed(
        f"{FIELD} {image!r} is not allowed: it must resolve to a directory inside reward.image_roots ({allowed})"
    )
