#!/usr/bin/env bash
# One GPU check in one call, at most 10 minutes on one H100: the cuda tests, the benchmark rows, a
# kernel profile of the compile row, and the versions. Run from the repository root.
#
#   bash scripts/gpu_check.sh --fetch-wheels   # here, with network: the packages the GPU image lacks,
#                                              # as Python 3.12 wheels into .whl/ (git-ignored)
#   bash scripts/gpu_check.sh --dry            # here, on CPU: rehearse every step on the debug model
#   bash scripts/gpu_check.sh                  # on the GPU machine
#
# The device call (the GPU image has torch and triton, not torchao/torchdata/tomli_w: they travel
# as the wheels in .whl/, installed by step 0 into /tmp/site):
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=600)
# Everything is written under $OUT (default: outputs/gpu_check): one log per step (the benchmark rows
# together in bench.log) and summary.txt
# (one line per step: ok / FAILED with its exit status, and seconds). Each step runs under its own
# time limit and a failed step never stops the next one.
#
# Steps, most informative first, and their limits (seconds). The whole run keeps a budget of 570 s
# (the call's 10 minutes less start-up): a step gets at most what is left of it, and a step with
# under 10 s left is skipped with that reason, so the summary always comes back.
#   0 install   the carried wheels (needed by every later step)                               20
#   1 versions  nvidia-smi; torch / CUDA / triton / torchao versions                           15
#   2 smoke-F   every model family registered in titan.models (a new one joins by registering):
#               its debugmodel flavor in bf16 parameters, 20 steps (scripts/benchmark.py
#               --preset families_bf16): the last loss and peak memory              45 each
#   3 pytest    python -m pytest -m cuda tests -x -q, each test at most PER_TEST_TIMEOUT s    150
#   4 bench-ROW scripts/benchmark.py --preset llama3_8b_8layers --only ROW --warmup 5
#               --steps 10, one process per row so a slow row hides no other: medians over
#               steps 6-15                                          eager 60, others 90 each
#   5 moe       llama4's debug shape in bf16 at EP 1, and at EP = the GPUs present when more
#               than one (scripts/benchmark.py --preset llama4_debug)                        60
#   5 moe-F     the other MoE families' GPU shapes at EP 1: DeepSeek-V3 16B and gpt-oss 20b cut
#               to 2 layers (one GPU's memory), scripts/benchmark.py --preset deepseek_v3_16b_4layers /
#               gpt_oss_20b_4layers; the CPU rehearsal skips them (the shapes do not fit a CPU run:
#               smoke-F ran both families)                                                60 each
#   5 gdn       the Gated DeltaNet's fla kernels vs its exact torch path on qwen3_5's debug model
#               in bf16, seq 2048 (scripts/benchmark.py --preset qwen3_5_gdn): tokens/s of each and
#               the same last loss within 2% (bf16); the CPU rehearsal runs the torch row and
#               skips the fla one with its reason                                            90
#   6 optim     AdamW vs Muon step time on the 8B shape cut to 2 layers (skipped, saying so,
#               while optimizer.name Muon is not registered)                                 60
#   7 profile   scripts/profile_step.py: the compile row, 3 warm-up + 2 recorded steps, top 15
#               kernels by device time and the host gap per step (profiler's own table)         60
# The benchmark tables carry each row's peak memory (CUDA max reserved) and last loss.
#
# Summary lines: "NAME: ok (Ns)", "NAME: skipped: WHY (Ns)", "NAME: FAILED: ... (Ns)"; the exit
# status is 1 only when a step FAILED.
#
# Options: --dry (CPU rehearsal: the debug model cut to 2 layers, seq 64, 1 warm-up + 1 timed
# step, limits x4, no overall budget; what CPUs cannot run - flex attention's backward, float8
# matmuls, bf16 grouped GEMMs - is skipped with its reason when the step fails with it, any other
# failure fails), --only ROWS (benchmark rows, default
# eager,compile,float8-tensorwise,flex; the profile takes the compile row, or the first row
# without it), --steps NAMES (run only these steps of the list above, e.g. install,moe), --tests
# PATH (where pytest looks for the cuda tests, default tests), --fetch-wheels.
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
DRY=0
ROWS="eager,compile,float8-tensorwise,flex"
WHEELS=(torchao==0.18.0 torchdata==0.11.0 tomli_w==1.2.0)
PER_TEST_TIMEOUT=90
TESTS=tests
STEPS=all
while [ $# -gt 0 ]; do
    case "$1" in
        --dry) DRY=1 ;;
        --tests) TESTS="${2:?--tests needs a test path}"; shift ;;
        --only) ROWS="${2:?--only needs a comma-separated list of benchmark rows}"; shift ;;
        --steps) STEPS="${2:?--steps needs a comma-separated list of step names}"; shift ;;
        --fetch-wheels)
            exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
                --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
                --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}" ;;
        *) echo "gpu_check.sh: unknown option '$1'; valid: --dry, --only ROWS, --steps NAMES, --tests PATH, --fetch-wheels" >&2; exit 2 ;;
    esac
    shift
done
OUT=${OUT:-$REPO/outputs/gpu_check}
mkdir -p "$OUT"
rm -f "$OUT"/*.log
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
export PYTHONUNBUFFERED=1 PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}

BUDGET=570
# step NAME LIMIT_S CMD...: run with a time limit (and within what is left of the budget), log to
# $OUT/NAME.log, one summary line. Exit status 77 (printed reason: a last line "skipped: WHY") is a
# skip, not a failure.
step() {
    local name=$1 limit=$2 t0 rc left
    local log=$OUT/${name%%-*}.log  # bench-ROW steps share bench.log (the device returns at most 8 files)
    shift 2
    case ",$STEPS," in ,all,|*,"${name%%-*}",*|*,"$name",*) ;; *) return 0 ;; esac
    limit=$((limit * LIMIT_SCALE))
    t0=$(date +%s)
    if [ $DRY -eq 0 ]; then
        left=$((BUDGET - (t0 - T0)))
        if [ $left -lt 10 ]; then
            echo "$name: skipped: no time left in the ${BUDGET}s budget (0s)" | tee -a "$SUMMARY"
            return 0
        fi
        [ $left -lt "$limit" ] && limit=$left
    fi
    echo "=== $name: $*" | tee -a "$log"
    # Shell functions (install_wheels, versions, bench_row, ...) run in a child bash, which gets them
    # exported; "$@" keeps each argument whole (benchmark variants hold spaces).
    if [ "$(type -t "$1")" = function ]; then set -- bash -c '"$@"' bash "$@"; fi
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    local took=$(($(date +%s) - t0))
    tail -n 40 "$log"
    if [ $rc -eq 0 ]; then
        echo "$name: ok (${took}s)" | tee -a "$SUMMARY"
    elif [ $rc -eq 77 ]; then
        echo "$name: $(grep '^skipped: ' "$log" | tail -n 1) (${took}s)" | tee -a "$SUMMARY"
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        echo "$name: FAILED: over its ${limit}s limit (${took}s)" | tee -a "$SUMMARY"
    else
        echo "$name: FAILED: exit $rc (${took}s)" | tee -a "$SUMMARY"
    fi
}

install_wheels() {
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        if [ $DRY -eq 1 ]; then
            echo "no .whl/: the installed packages are used (run --fetch-wheels before the device call)"
            return 0
        fi
        echo "no wheels in .whl/: run 'bash scripts/gpu_check.sh --fetch-wheels' here and carry .whl" >&2
        return 1
    fi
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
}

versions() {
    nvidia-smi || echo "nvidia-smi: not available (no NVIDIA driver on this machine)"
    "$PY" - <<'EOF'
import importlib.metadata as md
import os

import torch

cuda = torch.cuda.is_available()
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}); GPU: {torch.cuda.get_device_name() if cuda else 'none'}")
for name in ("triton", "torchao", "torchdata"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} not installed")
raise SystemExit(0 if cuda or os.environ["DRY"] == "1" else 1)  # the real run needs the GPU visible
EOF
}
# Benchmark rows (scripts/benchmark.py ARGS); benchmark.py prints a config that failed as a "failed"
# row and exits 0, so the step fails on that row too, unless (rehearsal) the failure is a CPU gap.
bench_row() {
    local table rc i
    # What a CPU cannot run (the rehearsal skips a row that fails with it): pattern, then the reason.
    local gaps=(
        "has no CPU backward|does not support backward on CPU" "flex attention has no backward on CPU"
        "strides should be multiple of 16 bytes" "bf16 grouped GEMMs (torch._grouped_mm) do not run on CPU"
        "_scaled_mm.*(CPU|cpu)|float8.*not (supported|implemented).*(CPU|cpu)" "float8 matmuls need a GPU"
    )
    table=$(mktemp)
    # shellcheck disable=SC2086  # DRY_ARGS: words without spaces, split on purpose
    "$PY" scripts/benchmark.py "$@" $DRY_ARGS 2>&1 | tee "$table"
    rc=${PIPESTATUS[0]}
    if grep -q "| failed" "$table"; then rc=1; fi
    if [ $rc -ne 0 ] && [ "$DRY" = 1 ]; then
        for ((i = 0; i < ${#gaps[@]}; i += 2)); do
            if grep -Eq "${gaps[i]}" "$table"; then
                echo "skipped: ${gaps[i + 1]} (CPU rehearsal)"
                rc=77
                break
            fi
        done
    fi
    rm -f "$table"
    return $rc
}
# AdamW vs Muon, or a skip while titan has no Muon.
optim_rows() {
    if ! "$PY" -c "from titan.training.optim import OPTIMIZERS; raise SystemExit('muon' not in {n.lower() for n in OPTIMIZERS})"; then
        echo "skipped: optimizer.name Muon is not registered in titan.training.optim.OPTIMIZERS"
        return 77
    fi
    bench_row "$@" --variant "adamw=--optimizer.name AdamW" --variant "muon=--optimizer.name Muon"
}
# A family's GPU shape at EP 1, 2 layers; or the rehearsal's skip (its widths do not fit a CPU run).
moe_shape() {
    if [ "$DRY" = 1 ]; then
        echo "skipped: the $1 shape does not fit a CPU rehearsal (the family's smoke step ran it)"
        return 77
    fi
    bench_row --preset "$1" --only "EP 1" --model.n_layers 2
}
# Gated DeltaNet: fla's kernels and the torch path, the same loss within bf16's tolerance.
gdn_rows() {
    local table rc
    if [ "$DRY" = 1 ]; then
        bench_row --preset qwen3_5_gdn --only torch || return $?
        echo "skipped: fla's kernels need CUDA (CPU rehearsal: the torch row ran)"
        return 77
    fi
    table=$(mktemp)
    bench_row --preset qwen3_5_gdn | tee "$table"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 0 ]; then
        "$PY" - "$table" <<'EOF'
import re
import sys

text = open(sys.argv[1]).read()
rows = {m[1]: float(m[2]) for m in re.finditer(r"^\| (torch|fla) .*\| ([0-9.]+) +\|$", text, re.M)}
diff = abs(rows["fla"] - rows["torch"]) / rows["torch"]
print(f"last loss: torch {rows['torch']}, fla {rows['fla']} (relative difference {diff:.2e}, bf16 tolerance 2e-2)")
raise SystemExit(0 if diff < 2e-2 else 1)
EOF
        rc=$?
    fi
    rm -f "$table"
    return "$rc"
}
SITE=/tmp/site
LIMIT_SCALE=1
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ $DRY -eq 1 ]; then
    SITE=$(mktemp -d)
    LIMIT_SCALE=4  # a shared 2-core CPU is slower than the GPU machine's 16 cores at everything here
    # The debug model, small: what the rows and the profile run on CPU (2 layers: llama4's MoE
    # blocks are every second one).
    SHAPE=(--model.n_layers 2 --training.seq_len 64 --training.local_batch_size 2)
    DRY_ARGS="--configs gpu --warmup 1 --steps 1 ${SHAPE[*]}"
    ROW_ARGS=()
    PROFILE=(--warmup 1 --steps 1 "${SHAPE[@]}")
else
    DRY_ARGS=""
    ROW_ARGS=(--preset llama3_8b_8layers --warmup 5 --steps 10)
    PROFILE=(--preset llama3_8b_8layers --warmup 3 --steps 2)
fi
case ",$ROWS," in *,compile,*) PROFILE_ROW=compile ;; *) PROFILE_ROW=${ROWS%%,*} ;; esac
MOE_ROWS=ep1
[ "$GPUS" -gt 1 ] && MOE_ROWS=ep1,ep-gpus

export -f install_wheels versions bench_row optim_rows moe_shape gdn_rows
export DRY SITE PY DRY_ARGS
T0=$(date +%s)
step install 20 install_wheels
export PYTHONPATH=$SITE:$PYTHONPATH
step versions 15 versions
for family in $("$PY" -c "from titan.models import model_names; print(' '.join(model_names()))"); do
    step "smoke-$family" 45 bench_row --preset families_bf16 --only "$family"
done
step pytest 150 "$PY" -m pytest -m cuda "$TESTS" -x -q -p no:cacheprovider --timeout "$PER_TEST_TIMEOUT"
for row in ${ROWS//,/ }; do
    if [ "$row" = eager ]; then limit=60; else limit=90; fi
    step "bench-$row" $limit bench_row "${ROW_ARGS[@]}" --only "$row"
done
step moe 60 bench_row --preset llama4_debug --only "$MOE_ROWS"
for preset in deepseek_v3_16b_4layers gpt_oss_20b_4layers; do
    step "moe-${preset%%_[0-9]*}" 60 moe_shape "$preset"
done
step gdn 90 gdn_rows
step optim 60 optim_rows "${ROW_ARGS[@]}" --model.n_layers 2
step profile 60 "$PY" scripts/profile_step.py --row "$PROFILE_ROW" --top 15 "${PROFILE[@]}"
echo "total: $(($(date +%s) - T0))s" | tee -a "$SUMMARY"
[ $DRY -eq 1 ] && rm -rf "$SITE"
echo "summary ($SUMMARY):"
cat "$SUMMARY"
! grep -q FAILED "$SUMMARY"
