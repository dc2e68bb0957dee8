#!/usr/bin/env bash
# The compiled training path on one lent GPU, in one call of at most ~9 minutes (issue 43): the CUDA checks
# (gpu_train_checks.py), then the training-step benches eager and compiled, then the loader's rate beside
# the step's. Every JSON line goes to $OUT/gpu_train.jsonl, all output to $OUT/gpu_train.log; a step that
# would pass the deadline is skipped and named, so a second call can run just those (STEPS="...").
#
#   bash tests/benchmarks/gpu_train.sh                        # every step, deadline 540 s
#   STEPS="onestream vilbert cudagraphs" bash tests/benchmarks/gpu_train.sh   # a second call: the rest
#
# Needs torch with CUDA and transformers (no Ray). PY picks the interpreter (default: python).
set -u
PY=${PY:-python}
OUT=${OUT:-/tmp/gpu_train}
DEADLINE=${DEADLINE:-540}
STEPS=${STEPS:-"checks lxmert_eager lxmert_compiled input onestream vilbert cudagraphs"}
mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/gpu_train_inductor}  # memory children reuse it
LOG=$OUT/gpu_train.log
JSONL=$OUT/gpu_train.jsonl
START=$(date +%s)
B=tests/benchmarks

source tests/benchmarks/gpu_steps.sh

{
    nvidia-smi -L
    $PY -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'
} 2>&1 | tee -a "$LOG"

step checks 110 $PY $B/gpu_train_checks.py
step lxmert_eager 90 $PY $B/bench_model.py --device cuda --bf16 --batch 128 --steps 20
step lxmert_compiled 170 $PY $B/bench_model.py --device cuda --bf16 --batch 128 --steps 20 --compile
# the loader beside the step: samples/s one DataLoader delivers with the README's 4 worker processes
step input 50 $PY $B/bench_input.py --quick --new-only --batch 128 --loader-workers 4
step onestream 150 $PY $B/bench_onestream.py --device cuda --bf16 --batch 128 --steps 20 --compile --no-memory
step vilbert 150 $PY $B/bench_vilbert.py --device cuda --bf16 --batch 128 --steps 20 --compile --no-memory
step cudagraphs 120 $PY $B/bench_model.py --device cuda --bf16 --batch 128 --steps 20 --no-memory \
    --compile --compile-mode reduce-overhead

# one table: what the step consumes against what the loader delivers, per GPU
$PY - "$JSONL" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for r in rows:
    if r.get("name") == "lxmert_pretrain_step":
        print(f"{r['step']:<16} {r['device']}: xmodal {r['ours_samples_per_s']:.0f} samples/s "
              f"(compile {r['compile']}), transformers {r['hf_samples_per_s']:.0f}, ratio {r['ratio']:.2f}, "
              f"peak MB {r.get('ours_peak_cuda_mb', 0)} vs {r.get('hf_peak_cuda_mb', 0)}")
    elif r.get("name") == "onestream_pretrain_step":
        print(f"{r['step']:<16} VL-BERT {r['vlbert_samples_per_s']:.0f} samples/s, "
              f"LXMERT {r['lxmert_samples_per_s']:.0f} (compile {r['compile']})")
    elif r.get("name") == "vilbert_vs_lxmert_pretrain_step":
        print(f"{r['step']:<16} ViLBERT {r['vilbert_samples_per_s']:.0f} samples/s, "
              f"LXMERT {r['lxmert_samples_per_s']:.0f} (compile {r['compile']})")
    elif r.get("name") == "input":
        d = r["new_samples_per_s"]["pretrain"]["delivered"]
        print(f"{r['step']:<16} loader delivers {d:.0f} pre-training samples/s with "
              f"{r['loader_workers']} worker(s)")
    elif r.get("name", "").startswith("gpu_check"):
        print(f"{r['step']:<16} {json.dumps(r)}")
EOF
echo "total $(($(date +%s) - START)) s" | tee -a "$LOG"
exit $status
