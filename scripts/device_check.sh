#!/usr/bin/env bash
# The GPU check in one command (see scripts/device_check.py). On the GPU machine, from the repository root:
#     bash scripts/device_check.sh "$OUT"        # with .whl/ carried (scripts/fetch_device_wheels.sh fills it)
# Installs the carried wheels into /tmp/site (nothing can be downloaded there), then runs the check on CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
output="${1:?usage: device_check.sh OUTPUT_DIR [--quick]}"
shift
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
python3 scripts/device_check.py --output "$output" "$@" 2>&1 | tee "$output/device_check.log"
