#!/usr/bin/env bash
# Wheels that bench/gpu.py needs and the lent GPU machine's image lacks (it has no network), into the ignored .whl/.
#
#   bash bench/gpu_wheels.sh                  # trl, datasets, dill, multiprocess, transformers, peft (~16 MB)
#   bash bench/gpu_wheels.sh --bitsandbytes   # and bitsandbytes, for QFoRA on CUDA (+43 MB: the 64 MiB a call
#                                             # carries then holds little else beside the project)
#
# Why each: the image (Python 3.12, torch 2.11 + CUDA 13, accelerate 1.15) has no trl, datasets, dill,
# multiprocess or bitsandbytes; its transformers (5.17 when last read) is below the project's floor 5.20.1 and
# below 5.23, which `fora train`'s `activation_checkpointing` key needs; its peft version is unread, so 0.21.2
# (the floor) travels too. The versions are the main virtualenv's, the ones the suite passes on. Everything else
# they import is on the image (huggingface-hub, tokenizers, safetensors, pyarrow, pandas, xxhash, pyyaml, ...).
#
# Then the device tool's `run`, with carry [".whl"] and timeout_s 590 (one command, under 2,000 characters):
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 || exit; nvidia-smi; set -o pipefail; PYTHONUNBUFFERED=1 python3 bench/gpu.py --device cuda --out $OUT 2>&1 | tee $OUT/gpu.log
#
# (HF_*_OFFLINE: the machine reaches no network, and a library that tries would wait for its timeouts.)
# $OUT gets gpu.json (every number, the GPU, the driver, every package version), gpu.md (the tables) and gpu.log.
# Sections not started after --budget seconds (420) are skipped, and the JSON is rewritten after each section,
# so a run cut short still brings back what it measured. To re-run only some sections in a second call, add e.g.
# `--only qfora plan`.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=(trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 transformers==5.24.0 peft==0.21.2)
if [[ ${1:-} == --bitsandbytes ]]; then
    WHEELS+=(bitsandbytes==0.50.2)
elif [[ -n ${1:-} ]]; then
    echo "usage: $0 [--bitsandbytes]" >&2
    exit 2
fi

mkdir -p .whl
# The device's Python (3.12, CPython, x86-64 manylinux), whatever this machine's is. --no-deps: the image has
# the rest, and a second version of a package there would stop the whole install.
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl "${WHEELS[@]}"

# One version of each package: a wheel left from another version would be installed beside it.
names=$(for w in .whl/*.whl; do basename "$w" | cut -d- -f1 | tr '[:upper:]' '[:lower:]'; done | sort)
duplicates=$(uniq -d <<<"$names")
if [[ -n $duplicates ]]; then
    echo "several versions in .whl/ of: $duplicates; delete the old wheels" >&2
    exit 1
fi
du -ch .whl/*.whl | tail -1
