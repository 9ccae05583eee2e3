#!/usr/bin/env bash
# Wheels the lent GPU machines' image lacks (Python 3.12, x86-64) for bench/gpu.py, into .whl/
# (ignored by git; carried to the machine). The learner's modules import the run config's classes
# (pydantic) and the message contracts (msgspec); torch, transformers, safetensors, pyyaml and
# peft are in the image. Then, on the machine (carry: [".whl"]):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && python3 bench/gpu.py 2>&1 | tee $OUT/gpu.log
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
wheels=(pydantic pydantic-core pydantic-settings python-dotenv typing-inspection annotated-types msgspec)
pins=()
for name in "${wheels[@]}"; do  # the versions this checkout runs with
    pins+=("$name==$(python3 -m pip show "$name" | awk '/^Version/{print $2}')")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
ls .whl
