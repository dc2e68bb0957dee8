#!/usr/bin/env bash
# The extraction half of tests/benchmarks/gpu_all.py (the one prepared GPU call; see its docstring):
#   bash tests/benchmarks/gpu_extract.sh [--budget S] [--detector-weights DIR]
exec "${PY:-python3}" tests/benchmarks/gpu_all.py --steps env parity extract_checks extract_bench "$@"
