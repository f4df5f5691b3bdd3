#!/usr/bin/env bash
# Fill .whl/ (ignored by git) with the pure-Python wheels the GPU machine lacks, for its Python 3.12: there
# transformers is 5.17 and hf_spec pins 5.24 (its other needs, huggingface-hub >= 1.31, tokenizers 0.23, safetensors
# 0.8, are already on that image, see the device tool's KINDS.md). About 13 MiB; the limit for what travels is 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl transformers==5.24.0
du -sh .whl
