#!/usr/bin/env bash
# The GPU round of issue 46 in one command: every figure the issue asks for, inside 8 minutes on one H100,
# nothing downloaded. Each step writes its JSON straight to $OUT under its own `timeout`, so a step cut short
# or failing leaves the others' figures; engine-only steps first, transformers last (on a subset of requests).
#
#   bash bench/gpu_round.sh wheels       # HERE, once (needs pip and a registry): the wheels the device image
#                                        # lacks (pydantic and its family, gguf) into .whl/ (git-ignored)
#   bash bench/gpu_round.sh              # ON THE DEVICE, with .whl carried: the round (run(command=..., carry=[".whl"]))
#   DRY_RUN=1 bash bench/gpu_round.sh    # HERE, on the CPU: the same steps at --smoke size, tests collected
#                                        # only: proves the plumbing; $OUT defaults to a temporary folder
#
# Comes back in $OUT: log.txt (every step's output), tests.txt, kernel_bandwidth.json, engine_throughput.json
# (one row per model: the engine as shipped on top, the other scheduling and the unfused run nested, then
# transformers' figures), and summary.txt (bench/gpu_round_summary.py: the figures against the issue's goals).
# BUDGET_S (default 470) is the whole round's wall-clock budget; each step's timeout is its own share, cut to
# what is left of the budget. A second command on the warm machine can rerun some steps: STEPS names them
# (e.g. STEPS="transformers"), REPORT_FROM a copy of the engine_throughput.json that came back (carried in the
# checkout), which those steps then fill in; the checkpoints in $CKPT are still there on a warm machine.
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        typing-extensions==4.16.0 gguf==0.19.0)
if [[ "${1:-}" == wheels ]]; then
  mkdir -p .git/info && { grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude; }
  exec "${PYTHON:-.venv/bin/python}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
fi

export PYTHONUNBUFFERED=1
START=$(date +%s)
BUDGET_S=${BUDGET_S:-470}
if [[ -n "${DRY_RUN:-}" ]]; then
  PY=${PYTHON:-.venv/bin/python}
  OUT=${OUT:-$(mktemp -d /tmp/gpu-round-dry.XXXXXX)}
  SMOKE=(--smoke)
  PROFILE_STEPS=2      # the smoke run's 8 requests: 20 profiled steps would outrun them
  PYTEST_MODE=(--collect-only -q)
else
  PY=${PYTHON:-python3}  # the device image's own Python, torch, triton and transformers
  SMOKE=()
  PROFILE_STEPS=20
  PYTEST_MODE=(-q -rfE)
fi
: "${OUT:?OUT must name the folder whose files come back}"
mkdir -p "$OUT"
LOG="$OUT/log.txt"
CKPT=${CKPT:-/tmp/kvguard-checkpoints}  # random-weight checkpoints, written once, read by every step
REPORT="$OUT/engine_throughput.json"
[[ -n "${REPORT_FROM:-}" ]] && cp "$REPORT_FROM" "$REPORT"

say() {
  [[ -s "$LOG" && -n "$(tail -c1 "$LOG")" ]] && echo | tee -a "$LOG"  # the line a step left open (nanobind's)
  echo "# $(date -u +%H:%M:%S) +$(($(date +%s) - START))s: $*" | tee -a "$LOG"
}

# step NAME SECONDS COMMAND...: COMMAND under `timeout`, for SECONDS or what is left of the budget if less;
# its output in the log; its exit status in the log and as its own.
step() {
  local name=$1 seconds=$2 left
  shift 2
  if [[ -n "${STEPS:-}" && " $STEPS " != *" $name "* ]]; then
    return 0
  fi
  left=$((BUDGET_S - ($(date +%s) - START)))
  ((seconds > left)) && seconds=$left
  if ((seconds < 20)); then
    say "$name: skipped, ${left}s of the budget left"
    return 0
  fi
  say "$name: start (timeout ${seconds}s): $*"
  timeout -k 10 "$seconds" "$@" 2>&1 | tee -a "$LOG"
  local status=${PIPESTATUS[0]}
  say "$name: exit $status$( ((status == 124)) && echo ' (timed out)')"
  return "$status"
}

if ! "$PY" -c 'import pydantic, gguf' 2>/dev/null; then
  [[ -d .whl ]] || { say "pydantic or gguf missing and no .whl/: run 'bash bench/gpu_round.sh wheels' here, carry .whl"; exit 3; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { say "installing .whl/ failed"; exit 3; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
say "machine: $(nvidia-smi -L 2>/dev/null | head -1 || echo 'no nvidia-smi'); $("$PY" -c 'import torch, triton, transformers;
print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}, cuda {torch.cuda.is_available()}")')"
ENGINE=("$PY" bench/engine_throughput.py "${SMOKE[@]}" --checkpoint-dir "$CKPT" --json "$REPORT" --merge)

# 1. Correctness on the GPU. The fusion tests first and alone: if the fused kernels fail there, every engine
#    step below runs with them off (KVGUARD_CUDA_FUSION=0), so the round still brings its figures.
step fusion-tests 90 "$PY" -m pytest "${PYTEST_MODE[@]}" -p no:cacheprovider tests/engine/test_cuda_fusion.py \
  || { export KVGUARD_CUDA_FUSION=0; say "FUSION OFF for every engine step: the fusion tests failed"; }
step kernel-tests 120 "$PY" -m pytest "${PYTEST_MODE[@]}" -p no:cacheprovider tests/engine/test_kernels_triton.py \
  tests/engine/test_gpu_path.py
cp "$LOG" "$OUT/tests.txt"

# 2. The decode kernel against a device copy, timed inside CUDA graphs: batch 64/256 x context 2048/8192 and
#    the engine workload's own cell, for the three models' attention shapes.
step kernel-bandwidth 75 "$PY" bench/kernel_bandwidth.py "${SMOKE[@]}" --batches 64 256 --contexts 2048 8192 \
  --json "$OUT/kernel_bandwidth.json"

# 3. The engine, engine-only: Qwen2.5-0.5B shape with everything (the other scheduling, the fusions off, fused
#    vs unfused tokens in fp32, the kernel profile), then Llama-3.2-1B (the other scheduling).
step engine-qwen 170 "${ENGINE[@]}" --models qwen2.5-0.5b --hf skip --async-scheduling both --unfused \
  --fusion-check 64 --kernel-profile "$PROFILE_STEPS"
step engine-llama-1b 80 "${ENGINE[@]}" --models llama-3.2-1b --hf skip --async-scheduling both

# 4. The weight-bound shape: Llama-3.1-8B (random bf16 weights, 16 GB, built here), batch 64, contexts 960
#    to 1088, engine only, as shipped.
step engine-llama-8b 150 "${ENGINE[@]}" --models llama-3.1-8b --hf skip --num-requests 64 --max-num-seqs 64 \
  --min-len 960 --max-len 960 --output-len 128 128
rm -rf "$CKPT"/llama-3.1-8b-*  # 16 GB of disk and page cache the transformers step has better use for

# 5. transformers last, on the first 64 requests of the same workload in one batch, into the same rows.
step transformers 200 "${ENGINE[@]}" --models qwen2.5-0.5b llama-3.2-1b --hf only --hf-requests 64 \
  --hf-batch-size 64

# Optional, only when STEPS names it (a second command if device time remains): the split policy swept on
# the cells where it matters, to choose MIN_SPLIT_KEYS and check choose_num_splits (engine/kernels/triton_decode.py).
if [[ " ${STEPS:-} " == *" split-sweep "* ]]; then
  step split-sweep 120 "$PY" bench/kernel_bandwidth.py "${SMOKE[@]}" --shapes qwen2.5-0.5b llama-3.1-8b \
    --batches 64 256 --contexts 2048 --splits 1x256 2x256 4x128 4x256 4x512 8x256 --json "$OUT/split_sweep.json"
fi

say "round done"
"$PY" bench/gpu_round_summary.py "$OUT" | tee "$OUT/summary.txt"
