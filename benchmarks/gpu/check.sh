#!/usr/bin/env bash
# One GPU session's checks and measurements (issue 45), for a machine with its own torch and Triton
# and no internet, in about ten minutes: install Tandem over them, the `gpu`-marked tests, the
# benchmarks (benchmarks/gpu/bench.py) on dummy-weight checkpoints of Qwen3-0.6B's and Llama-3-8B's
# shapes, with the parity tests on CUDA after the first three (the steps are in priority order:
# what the budget cuts is the end). Everything lands in one folder:
#
#     bash benchmarks/gpu/check.sh [RESULTS_DIR]     # default: $OUT/gpu-h200-YYYY-MM-DD
#
# Before: `bash benchmarks/gpu/fetch_wheels.sh` here (the wheels the machine lacks, carried along).
# Each step has a time limit and the whole run a budget (CHECK_BUDGET_S, default 540 s): a step
# that would start with too little left is skipped and says so in steps.txt. A failing step does
# not stop the next one. A dry run here: CHECK_DEVICE=cpu CHECK_SHAPES=tiny CHECK_TESTS=0 (tiny shapes
# on the CPU, no tests) runs every benchmark step of the script end to end.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD"
RESULTS="${1:-${OUT:-/tmp}/gpu-h200-$(date -u +%Y-%m-%d)}"
mkdir -p "$RESULTS"
BUDGET="${CHECK_BUDGET_S:-540}"
START=$(date +%s)
PY="${PYTHON:-python3}"
STEPS="$RESULTS/steps.txt"
DEV="${CHECK_DEVICE:-cuda}"
SMALL_SHAPE=qwen3-0.6b BIG_SHAPE=llama3-8b
NSEQ=256 MINLEN=100 MAXLEN=1024 OUTLEN=256 PREFILL=4096
if [ "${CHECK_SHAPES:-}" = tiny ]; then
    SMALL_SHAPE=tiny BIG_SHAPE=tiny NSEQ=8 MINLEN=10 MAXLEN=40 OUTLEN=16 PREFILL=256
fi
: >"$STEPS"

left() { echo $((BUDGET - ($(date +%s) - START))); }

# step NAME LIMIT_S COMMAND...: run with a time limit (cut to the budget left), log to NAME.log.
step() {
    local name=$1 limit=$2 rest
    shift 2
    rest=$(left)
    if ((rest < 25)); then
        echo "$name: skipped (budget spent)" | tee -a "$STEPS"
        return
    fi
    ((limit > rest)) && limit=$rest
    local t0
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$RESULTS/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc seconds=$(($(date +%s) - t0)) limit=$limit" | tee -a "$STEPS"
    tail -n 3 "$RESULTS/$name.log"
}

export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The C++ CPU kernels are never needed here: no build on the GPU machine (a CPU-path engine in a
# test then runs PyTorch's operators).
export TANDEM_CPU_KERNELS=0

{
    date -u
    nvidia-smi
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,power.limit --format=csv
    "$PY" -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} >"$RESULTS/nvidia-smi.txt" 2>&1
cat "$RESULTS/nvidia-smi.txt" | head -n 20
git -C "$ROOT" rev-parse HEAD >"$RESULTS/commit.txt" 2>/dev/null || true

# -- install over the machine's torch and Triton -----------------------------------------------
do_install() {
    local wheels="$ROOT/benchmarks/gpu/wheels"
    if [ -d "$wheels" ]; then
        "$PY" -m pip install --no-index --find-links "$wheels" -r "$ROOT/benchmarks/gpu/requirements.txt" || return 1
    else
        echo "no $wheels: relying on what the machine has"
    fi
    "$PY" -m pip install --no-deps --no-build-isolation -e "$ROOT" || return 1
    "$PY" -c "import torch, triton, tandem; from tandem import LLM; print('tandem ok, torch', torch.__version__)"
}
export -f do_install
export PY ROOT
step install 150 bash -c do_install
# Without the editable install (setuptools missing or too old), the source tree on the path.
if ! "$PY" -c "import tandem" 2>/dev/null; then
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    echo "tandem imported from the source tree (PYTHONPATH)" | tee -a "$STEPS"
fi

# -- tests: the gpu-marked ones first (the parity tests on CUDA run after the first benchmarks) ----
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts= -rA)
[ "${CHECK_TESTS:-1}" = 1 ] && step tests-gpu 120 "${PYTEST[@]}" -m gpu tests/gpu --junitxml="$RESULTS/tests-gpu.xml"

# -- benchmarks ------------------------------------------------------------------------------
MODELS="${TMPDIR:-/tmp}/tandem-gpu-models"
"$PY" benchmarks/gpu/make_config.py --shape "$SMALL_SHAPE" --out "$MODELS/qwen3-0.6b" >/dev/null
"$PY" benchmarks/gpu/make_config.py --shape "$BIG_SHAPE" --out "$MODELS/llama3-8b" >/dev/null
BENCH=("$PY" benchmarks/gpu/bench.py --device "$DEV")
LIMITS="$RESULTS/limits.json"
step limits 40 "${BENCH[@]}" limits --out "$LIMITS"
L=()
[ -s "$LIMITS" ] && L=(--limits "$LIMITS")
step decode-llama3-8b 90 "${BENCH[@]}" decode --model "$MODELS/llama3-8b" ${L[@]+"${L[@]}"} \
    --prompt-len 512 --output-len "$OUTLEN" --max-model-len 8192 --out "$RESULTS/decode-llama3-8b.json"
step prefill-llama3-8b 70 "${BENCH[@]}" prefill --model "$MODELS/llama3-8b" ${L[@]+"${L[@]}"} \
    --tokens "$PREFILL" --max-model-len 8192 --out "$RESULTS/prefill-llama3-8b.json"
step throughput-qwen3-0.6b 100 "${BENCH[@]}" throughput --model "$MODELS/qwen3-0.6b" ${L[@]+"${L[@]}"} \
    --num-seqs "$NSEQ" --min-len "$MINLEN" --max-len "$MAXLEN" --max-model-len 4096 \
    --out "$RESULTS/throughput-qwen3-0.6b.json"
[ "${CHECK_TESTS:-1}" = 1 ] && step tests-parity-cuda 150 env TANDEM_TEST_DEVICE=cuda "${PYTEST[@]}" \
    tests/gpu/test_gpu_path_on_cpu.py tests/gpu/test_triton_parity.py --junitxml="$RESULTS/tests-parity-cuda.xml"
# Overlap scheduling on CUDA: outputs against the synchronous loop, one read per collected step.
[ "${CHECK_TESTS:-1}" = 1 ] && step tests-overlap-cuda 90 env TANDEM_TEST_DEVICE=cuda "${PYTEST[@]}" \
    tests/gpu/test_overlap_scheduling.py --junitxml="$RESULTS/tests-overlap-cuda.xml"
step decode-qwen3-0.6b 70 "${BENCH[@]}" decode --model "$MODELS/qwen3-0.6b" ${L[@]+"${L[@]}"} \
    --prompt-len 512 --output-len "$OUTLEN" --max-model-len 4096 --out "$RESULTS/decode-qwen3-0.6b.json"
step throughput-llama3-8b 150 "${BENCH[@]}" throughput --model "$MODELS/llama3-8b" ${L[@]+"${L[@]}"} \
    --num-seqs "$NSEQ" --min-len "$MINLEN" --max-len "$MAXLEN" --max-model-len 4096 \
    --out "$RESULTS/throughput-llama3-8b.json"
step profile-qwen3-0.6b 70 "${BENCH[@]}" profile --model "$MODELS/qwen3-0.6b" ${L[@]+"${L[@]}"} \
    --num-seqs "$NSEQ" --prompt-len 128 --output-len 64 --profile-steps 4 --max-model-len 4096 \
    --out "$RESULTS/profile-qwen3-0.6b.json" --trace-dir "$RESULTS"
gzip -f "$RESULTS"/*.json.trace "$RESULTS"/decode_trace.json 2>/dev/null || true
# The host link as swap preemption uses it (the default of `swap_bandwidth_gbps`, docs/defaults.md).
SWAP_ARGS=()
[ "${CHECK_SHAPES:-}" = tiny ] && SWAP_ARGS=(--blocks 8 --layers 2)
step swap-link 30 "$PY" benchmarks/gpu/swap_link.py --device "$DEV" ${SWAP_ARGS[@]+"${SWAP_ARGS[@]}"} \
    --out "$RESULTS/swap-link.json"

echo "done in $(($(date +%s) - START)) s; results in $RESULTS" | tee -a "$STEPS"
ls -la "$RESULTS"
