#!/usr/bin/env bash
# Runs every benchmark recorded in docs/benchmarks.md, one after another, on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
mkdir -p benchmarks/results
$PY tools/default_model_report.py --json docs/default_model.json | tee benchmarks/results/default_model.log
$PY benchmarks/throughput.py --threads 2 | tee benchmarks/results/throughput.log
$PY benchmarks/prefix_cache.py --threads 2 --num-requests 16 | tee benchmarks/results/prefix_cache.log
$PY benchmarks/spec_decode.py --threads 2 | tee benchmarks/results/spec_decode.log
$PY benchmarks/grammar_backends.py | tee benchmarks/results/grammar_backends.log
$PY benchmarks/structured_output.py | tee benchmarks/results/structured_output.log
