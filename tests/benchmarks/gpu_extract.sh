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

status=0
step() {  # step NAME LIMIT_S COMMAND...: run it under the time left, keep its JSON lines
    local name=$1 limit=$2
    shift 2
    case " $STEPS " in *" $name "*) ;; *) return ;; esac
    local left=$((DEADLINE - ($(date +%s) - START)))
    if ((left < 30)); then
        echo "== $name: skipped (${left} s left before the deadline)" | tee -a "$LOG"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (limit ${limit} s): $*" | tee -a "$LOG"
    local t0=$(date +%s)
    timeout "$limit" "$@" >"$OUT/$name.out" 2>>"$LOG"
    local rc=$?
    cat "$OUT/$name.out" | tee -a "$LOG"
    grep '^{' "$OUT/$name.out" | sed "s/^{/{\"step\": \"$name\", /" >>"$JSONL"
    echo "== $name: rc=$rc in $(($(date +%s) - t0)) s" | tee -a "$LOG"
    rm -f "$OUT/$name.out"
    ((rc == 0)) || status=1
}

B=tests/benchmarks
step checks 240 "$PY" tests/extraction/test_cuda_extraction.py
step bench 240 "$PY" $B/bench_extract_gpu.py --device cuda --compare
step per_image 150 "$PY" $B/bench_extract_gpu.py --device cuda --forward per-image --images 32
uptime | tee -a "$LOG"
exit $status
