#!/usr/bin/env bash
# The training half of tests/benchmarks/gpu_all.py (the one prepared GPU call; see its docstring):
#   bash tests/benchmarks/gpu_train.sh [--budget S]
exec "${PY:-python3}" tests/benchmarks/gpu_all.py --steps env train_checks lxmert_compiled lxmert_cudagraphs "$@"
