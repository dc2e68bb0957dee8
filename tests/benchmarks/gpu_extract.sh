#!/usr/bin/env bash
# Issue 42's GPU checks in one call of at most ~9 minutes on a lent H100/H200 (run from the repository root):
#
#   bash tests/benchmarks/gpu_extract.sh                  # every step, deadline 540 s
#   STEPS="bench" bash tests/benchmarks/gpu_extract.sh    # only some steps
#
# Steps (each under the time left; a step that would pass the deadline is skipped and named):
#   checks     tests/extraction/test_cuda_extraction.py as a script (the machine may lack pytest): batched
#              records bitwise the same alone or in any batch (float32 and bfloat16), two runs bitwise,
#              GPU float32 = CPU per-image up to rounding (same regions, features <= 1e-5 relative),
#              float32 convolutions NCHW;
#   bench      bench_extract_gpu.py --device cuda --compare: JPEG files -> decoder threads -> batched
#              detector -> LMDB store, float32 and bfloat16, the Detector API alone and its stage split,
#              the float32 store against the CPU per-image path (exit 1 when it differs);
#   per_image  the same bench with --forward per-image (the reference path on the GPU, NCHW float32).
# Every JSON line goes to $OUT/gpu_extract.jsonl (for BENCHMARKS.md), all output to $OUT/gpu_extract.log.
#
# Needs torch with CUDA, torchvision, opencv, pillow, numpy, pyyaml and lmdb (no Ray). lmdb is not on the
# lent machine: its wheels for CPython 3.10-3.13 sit in .gpu_wheels/ (git-ignored: pass it in the device
# tool's carry list; fetched with `pip download lmdb
# --only-binary=:all: --python-version 3.X -d .gpu_wheels`) and are installed into a private folder.
# PY picks the interpreter (default: python3).
set -u
PY=${PY:-python3}
OUT=${OUT:-/tmp/gpu_extract}
DEADLINE=${DEADLINE:-540}
STEPS=${STEPS:-"checks bench per_image"}
mkdir -p "$OUT"
LOG=$OUT/gpu_extract.log
JSONL=$OUT/gpu_extract.jsonl
START=$(date +%s)
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}

if ! "$PY" -c "import lmdb" 2>/dev/null; then
    SITE=/tmp/gpu_extract_site
    "$PY" -m pip install --quiet --no-index --find-links .gpu_wheels --target "$SITE" lmdb >>"$LOG" 2>&1
    export PYTHONPATH=$PYTHONPATH:$SITE
    "$PY" -c "import lmdb" 2>>"$LOG" || echo "lmdb is missing and no wheel in .gpu_wheels fits $PY" | tee -a "$LOG"
fi
{
    date -u
    uptime
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$PY" -c "import torch, torchvision; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'cudnn', torch.backends.cudnn.version(), 'torchvision', torchvision.__version__)"
} 2>&1 | tee -a "$LOG"

source tests/benchmarks/gpu_steps.sh

B=tests/benchmarks
step checks 240 "$PY" tests/extraction/test_cuda_extraction.py
step bench 240 "$PY" $B/bench_extract_gpu.py --device cuda --compare
step per_image 150 "$PY" $B/bench_extract_gpu.py --device cuda --forward per-image --images 32
uptime | tee -a "$LOG"
exit $status
