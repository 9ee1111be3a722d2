#!/usr/bin/env bash
# Runs the benchmarks recorded in docs/benchmarks*.md, one after another, on an otherwise idle
# machine (hours on 2 cores; the 415M and MoE checkpoints are built on first use under
# benchmarks/.cache). Each writes its JSON under benchmarks/results/ and its printout to a .log
# beside it. The side-by-side runs against vLLM, SGLang and llama.cpp
# (benchmarks/peers/run_peers.py) need those installed first (../shared/peers.md) and are not run here.
#   bash benchmarks/run_all.sh            # everything
#   bash benchmarks/run_all.sh int4 moe   # only the named ones
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
R=benchmarks/results
mkdir -p "$R"

declare -A RUN=(
  [default_model]="tools/default_model_report.py --json docs/default_model.json"
  [throughput]="benchmarks/throughput.py --threads 2"
  [prefix_cache]="benchmarks/prefix_cache.py --threads 2 --num-requests 16"
  [spec_decode]="benchmarks/spec_decode.py --threads 2 --methods off ngram draft --repeats 3"
  [grammar_backends]="benchmarks/grammar_backends.py"
  [structured_output]="benchmarks/structured_output.py"
  [paged_attention]="benchmarks/paged_attention.py --threads 2 --json $R/paged_attention.json"
  [gemm_paths]="benchmarks/gemm_paths.py --rows 1,8,32 --reps 3 --json $R/gemm_paths.json"
  [layer_ops]="benchmarks/layer_ops.py --batch-tokens 64"
  [int4]="benchmarks/int4.py"
  [kv_cache_dtype]="benchmarks/kv_cache_dtype.py --input-len 256 --output-len 64"
  [moe_experts]="benchmarks/moe_experts.py"
  [moe]="benchmarks/moe.py"
  [kv_transfer]="benchmarks/kv_transfer.py --out $R/kv_transfer.json"
  [cluster]="benchmarks/cluster.py --result-json $R/cluster.json --plot $R/migration_cost.png"
  [pd]="benchmarks/pd.py --result-json $R/pd.json"
  [reliability]="benchmarks/reliability.py --result-json $R/reliability.json"
  [per_token_cpu]="benchmarks/per_token_cpu.py --result-json $R/per_token_cpu.json"
  [sim_validation]="benchmarks/sim_validation.py --calibrate --result-json $R/sim_validation.json"
  [cluster_studies]="benchmarks/cluster_studies.py"
)
ORDER=(default_model throughput prefix_cache spec_decode grammar_backends structured_output paged_attention
  gemm_paths layer_ops int4 kv_cache_dtype moe_experts moe kv_transfer cluster pd reliability per_token_cpu
  sim_validation cluster_studies)

names=("$@")
[ ${#names[@]} -eq 0 ] && names=("${ORDER[@]}")
for name in "${names[@]}"; do
  if [ -z "${RUN[$name]+set}" ]; then
    echo "unknown benchmark '$name'; one of: ${ORDER[*]}" >&2
    exit 2
  fi
  echo "== $name: $PY ${RUN[$name]}"
  # shellcheck disable=SC2086
  $PY ${RUN[$name]} | tee "$R/$name.log"
done
