#!/usr/bin/env bash
# Wheels that bench/gpu.py needs and the lent GPU machine's image lacks (it has no network), into the ignored .whl/.
#
#   bash bench/gpu_wheels.sh                              # trl, datasets, dill, multiprocess, transformers, peft (~16 MB)
#   bash bench/gpu_wheels.sh --bitsandbytes               # and bitsandbytes, for QFoRA on CUDA (+7 MB, see below)
#   bash bench/gpu_wheels.sh --bitsandbytes --deepspeed   # and DeepSpeed with what it imports (+5 MB): bench/engines.py
#
# liger-kernel travels always (0.9 MB, pure Python: its Triton kernels compile on the GPU): the fast_path rows.
#
# Why each: the image (Python 3.12, torch 2.11 + CUDA 13, accelerate 1.15) has no trl, datasets, dill,
# multiprocess, bitsandbytes or deepspeed; its transformers (5.17 when last read) is below the project's floor 5.20.1
# and below 5.23, which `fora train`'s `activation_checkpointing` key needs; its peft version is unread, so 0.21.2
# (the floor) travels too. The versions are the main virtualenv's, the ones the suite passes on. Everything else
# they import is on the image (huggingface-hub, tokenizers, safetensors, pyarrow, pandas, xxhash, pyyaml, ...).
#
# bitsandbytes' wheel (43 MB) holds its CUDA kernels for every CUDA from 11.8 to 13.2: it is repacked with the CUDA 13
# ones only (the image's torch is built for CUDA 13.0; bitsandbytes loads libbitsandbytes_cuda130.so), 7 MB, so that
# everything fits the 64 MiB a call carries. DeepSpeed publishes no current wheel: it is built here from its source
# (`pip wheel --no-deps --no-build-isolation`: pure Python, its ops compile at run time where needed, with the image's
# nvcc and ninja; FoRA's DeepSpeed runs need none). The image also lacks what DeepSpeed imports: hjson, pydantic,
# pydantic-core, annotated-types and typing-inspection (typing-extensions travels too, for pydantic's floor).
#
# Then the device tool's `run`, with carry [".whl"] and timeout_s 590 (one command, under 2,000 characters):
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 || exit; nvidia-smi; set -o pipefail; PYTHONUNBUFFERED=1 python3 bench/gpu.py --device cuda --out $OUT 2>&1 | tee $OUT/gpu.log
#
# (HF_*_OFFLINE: the machine reaches no network, and a library that tries would wait for its timeouts.)
# $OUT gets gpu.json (every number, the GPU, the driver, every package version), gpu.md (the tables) and gpu.log.
# The default --budget (430 s) keeps the whole command near 480 s: a section or row starts only if the budget has
# its estimate left (the rest are skipped, saying so), and the JSON is rewritten after every row, so a run cut short
# still brings back what it measured. A second call, at once: the first's gpu.json copied into the worktree, then
# the same command with `--only` the sections left and `--reuse` that file added to gpu.py's arguments; the next
# lease's calls are in docs/gpu.md, "Running it".
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=(trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 transformers==5.24.0 peft==0.21.2
    liger-kernel==0.8.5)
DEEPSPEED=0
for flag in "$@"; do
    case $flag in
        --bitsandbytes) WHEELS+=(bitsandbytes==0.50.2) ;;
        --deepspeed)
            DEEPSPEED=1
            WHEELS+=(hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
                typing-inspection==0.4.5 typing-extensions==4.16.0)
            ;;
        *)
            echo "usage: $0 [--bitsandbytes] [--deepspeed]" >&2
            exit 2
            ;;
    esac
done

mkdir -p .whl
# The device's Python (3.12, CPython, x86-64 manylinux), whatever this machine's is. --no-deps: the image has
# the rest, and a second version of a package there would stop the whole install.
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl "${WHEELS[@]}"
if [[ $DEEPSPEED == 1 ]]; then
    # Built by this machine's Python, which must have torch (DeepSpeed's setup.py reads it): e.g. PYTHON=.venv/bin/python.
    "$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
fi

# bitsandbytes with its CUDA 13 kernels only: the other native libraries and their RECORD lines dropped.
for wheel in .whl/bitsandbytes-*.whl; do
    [[ -e $wheel ]] || continue
    "$PYTHON" - "$wheel" <<'PYTHON'
import re, sys, zipfile
from pathlib import Path

path = Path(sys.argv[1])
keep = re.compile(r"bitsandbytes/libbitsandbytes_(cuda13\d|cpu)\.so$")
with zipfile.ZipFile(path) as source:
    names = [n for n in source.namelist() if not n.endswith(".so") or keep.search(n)]
    if len(names) == len(source.namelist()):
        sys.exit(0)  # already repacked
    repacked = path.with_suffix(".tmp")
    with zipfile.ZipFile(repacked, "w", zipfile.ZIP_DEFLATED) as target:
        for name in names:
            data = source.read(name)
            if name.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = "\n".join(l for l in lines if not l.split(",")[0].endswith(".so") or keep.search(l.split(",")[0]))
                data = (data + "\n").encode()
            target.writestr(source.getinfo(name), data)
repacked.replace(path)
PYTHON
done

# One version of each package: a wheel left from another version would be installed beside it.
names=$(for w in .whl/*.whl; do basename "$w" | cut -d- -f1 | tr '[:upper:]' '[:lower:]'; done | sort)
duplicates=$(uniq -d <<<"$names")
if [[ -n $duplicates ]]; then
    echo "several versions in .whl/ of: $duplicates; delete the old wheels" >&2
    exit 1
fi
du -ch .whl/*.whl | tail -1
