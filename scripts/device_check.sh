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
# Two GPUs or more: a 2-rank tensor-parallel target (NCCL) speculating on the tiny pair, every rank's report kept.
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    python3 -c "from hf_spec.loading.tiny import build_tiny_pair as b; t, d = b(0); \
t.save_pretrained('$output/tp_models/target'); d.save_pretrained('$output/tp_models/draft')"
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m hf_spec.evaluation.tensor_parallel \
        --target "$output/tp_models/target" --draft "$output/tp_models/draft" --output "$output/tensor_parallel" \
        --device cuda --samples 200 2>&1 | tee "$output/tensor_parallel.log"
    rm -rf "$output/tp_models"
fi
