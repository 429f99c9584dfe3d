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
# Steps and their limits (seconds; the sum, 575, stays under the call's 10 minutes):
#   0 install   the carried wheels (needed by every later step)                               20
#   1 pytest    python -m pytest -m cuda tests -x -q, each test at most PER_TEST_TIMEOUT s    150
#   2 bench-ROW scripts/benchmark.py --preset llama3_8b_8layers --only ROW --warmup 5
#               --steps 10, one process per row so a slow row hides no other: medians over
#               steps 6-15 (the preset's own 10 + 20 steps do not fit 10 minutes with four
#               rows that each start and compile in their own process)     eager 60, others 90 each
#   3 profile   scripts/profile_step.py: the compile row, 3 warm-up + 2 recorded steps, top 15
#               kernels by device time and the host gap per step (profiler's own table)         60
#   4 versions  nvidia-smi; torch / CUDA / triton / torchao versions                           15
#
# Options: --dry (CPU rehearsal: the debug model cut to 1 layer, seq 64, 1 warm-up + 1 timed
# step, limits x4; fails only where CUDA is missing: with the default rows, the flex row, as flex
# attention has no CPU backward), --only ROWS (benchmark rows, default
# eager,compile,float8-tensorwise,flex; the profile takes the compile row, or the first row
# without it), --tests PATH (where pytest looks for the cuda tests, default tests), --fetch-wheels.
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
DRY=0
ROWS="eager,compile,float8-tensorwise,flex"
WHEELS=(torchao==0.18.0 torchdata==0.11.0 tomli_w==1.2.0)
PER_TEST_TIMEOUT=90
TESTS=tests
while [ $# -gt 0 ]; do
    case "$1" in
        --dry) DRY=1 ;;
        --tests) TESTS="${2:?--tests needs a test path}"; shift ;;
        --only) ROWS="${2:?--only needs a comma-separated list of benchmark rows}"; shift ;;
        --fetch-wheels)
            exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
                --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
                --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}" ;;
        *) echo "gpu_check.sh: unknown option '$1'; valid: --dry, --only ROWS, --tests PATH, --fetch-wheels" >&2; exit 2 ;;
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

# step NAME LIMIT_S CMD...: run with a time limit, log to $OUT/NAME.log, one summary line.
step() {
    local name=$1 limit=$2 t0 rc
    local log=$OUT/${name%%-*}.log  # bench-ROW steps share bench.log (the device returns at most 8 files)
    shift 2
    limit=$((limit * LIMIT_SCALE))
    t0=$(date +%s)
    echo "=== $name: $*" | tee -a "$log"
    # Shell functions (install_wheels, bench_row, versions) run in a child bash, which gets them exported.
    if [ "$(type -t "$1")" = function ]; then set -- bash -c "$*"; fi
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    local took=$(($(date +%s) - t0))
    tail -n 40 "$log"
    if [ $rc -eq 0 ]; then
        echo "$name: ok (${took}s)" | tee -a "$SUMMARY"
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
# One benchmark row; benchmark.py prints a config that failed as a "failed" row and exits 0, so the
# step fails on that row too.
bench_row() {
    local table rc
    table=$(mktemp)
    # shellcheck disable=SC2086  # BENCH_ARGS: words without spaces, split on purpose
    "$PY" $BENCH_ARGS --only "$1" 2>&1 | tee "$table"
    rc=${PIPESTATUS[0]}
    if grep -q "| failed" "$table"; then rc=1; fi
    rm -f "$table"
    return $rc
}
SITE=/tmp/site
LIMIT_SCALE=1
if [ $DRY -eq 1 ]; then
    SITE=$(mktemp -d)
    LIMIT_SCALE=4  # a shared 2-core CPU is slower than the GPU machine's 16 cores at everything here
    # The debug model, small: what the rows and the profile run on CPU.
    SHAPE=(--model.n_layers 1 --training.seq_len 64 --training.local_batch_size 2)
    BENCH=(scripts/benchmark.py --configs gpu --warmup 1 --steps 1 "${SHAPE[@]}")
    PROFILE=(--warmup 1 --steps 1 "${SHAPE[@]}")
else
    BENCH=(scripts/benchmark.py --preset llama3_8b_8layers --warmup 5 --steps 10)
    PROFILE=(--preset llama3_8b_8layers --warmup 3 --steps 2)
fi
case ",$ROWS," in *,compile,*) PROFILE_ROW=compile ;; *) PROFILE_ROW=${ROWS%%,*} ;; esac

BENCH_ARGS="${BENCH[*]}"
export -f install_wheels versions bench_row
export DRY SITE PY BENCH_ARGS
T0=$(date +%s)
step install 20 install_wheels
export PYTHONPATH=$SITE:$PYTHONPATH
step pytest 150 "$PY" -m pytest -m cuda "$TESTS" -x -q -p no:cacheprovider --timeout "$PER_TEST_TIMEOUT"
for row in ${ROWS//,/ }; do
    if [ "$row" = eager ]; then limit=60; else limit=90; fi
    step "bench-$row" $limit bench_row "$row"
done
step profile 60 "$PY" scripts/profile_step.py --row "$PROFILE_ROW" --top 15 "${PROFILE[@]}"
step versions 15 versions
echo "total: $(($(date +%s) - T0))s" | tee -a "$SUMMARY"
[ $DRY -eq 1 ] && rm -rf "$SITE"
echo "summary ($SUMMARY):"
cat "$SUMMARY"
! grep -q FAILED "$SUMMARY"
