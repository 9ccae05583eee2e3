"""The chart rendered as a cluster gets it (`helm template`), for the tests that use its objects."""

from __future__ import annotations

import shutil
import subprocess

import yaml
from conftest import ROOT, service_unavailable

CHART = ROOT / "deploy" / "helm" / "conveyor"
CREDENTIALS = "s3.existingSecret=conveyor-s3"  # what deploy/render-k8s.sh passes: a Secret the operator made


def helm_binary() -> str:
    found = shutil.which("helm") or (str(ROOT / ".tools/bin/helm") if (ROOT / ".tools/bin/helm").exists() else None)
    if found is None:
        service_unavailable("helm is not installed (bash install.sh puts it in .tools/bin)")
    return found


def render(helm: str, *sets: str, release: str = "conveyor", namespace: str = "conveyor",
           check: bool = True) -> subprocess.CompletedProcess:  # fmt: skip
    """`helm template` with ``sets``; the operator's S3 Secret unless ``sets`` name S3 credentials."""
    if not any(s.startswith("s3.") for s in sets):
        sets = (CREDENTIALS, *sets)
    cmd = [helm, "template", release, str(CHART), "--namespace", namespace]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=check)


def render_chart(*sets: str, release: str = "conveyor", namespace: str = "conveyor") -> list[dict]:
    return [d for d in yaml.safe_load_all(render(helm_binary(), *sets, release=release, namespace=namespace).stdout) if d]
