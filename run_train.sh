#!/usr/bin/env bash
# Launch titan on this machine with torchrun.
#   NGPU=8 CONFIG_FILE=train_configs/llama3_8b.toml ./run_train.sh --training.steps 100
# NGPU: processes to start (default: the number of GPUs, or 1 on a CPU-only machine).
# CONFIG_FILE: TOML config (default: the debug model). LOG_RANK: ranks whose output is shown
# (comma-separated, default 0). Extra arguments are passed to train.py as config overrides.
# Signals: kill -TERM / -USR1 <pid> or Ctrl-C: every rank finishes its step, saves a checkpoint
# (with checkpoint.enable) and stops; exit 0. A second Ctrl-C kills the ranks.
# MAX_RESTARTS: restarts of the ranks after a failure (default 0: a local debug run stops at its
# first error, with its line); each restart resumes from the newest checkpoint (--checkpoint.enable).
# A titan error (config, data, checkpoint) and a signal to the launcher are never restarted.
# REPLICA_GROUPS=N: N replica groups of NGPU ranks each on this machine, joined by torchft (needs
# `pip install 'titan[ft]'`): a lighthouse (unless TORCHFT_LIGHTHOUSE names a running one; port
# LIGHTHOUSE_PORT, default 29510) and one launcher per group, each restarting its own group when it
# fails (MAX_RESTARTS, default 3 here) while the others train on; a restarted group heals from a live
# peer. Group i writes to <job.dump_folder>/replica_<i> (the merged config's: TOML, then flags), uses
# GPUs i*NGPU .. i*NGPU+NGPU-1 and prefixes its lines with [replica<i>_rank<r>]. docs/fault_tolerance.md.
#   NGPU=1 REPLICA_GROUPS=2 ./run_train.sh --fault_tolerance.enable
# COMM_MODE=fake_backend: no training; one CPU process plays one rank of an NGPU-rank job and runs
# one training step of it on a fake process group with fake tensors (scripts/simulate.py): its
# memory by category, collectives and device-to-host reads, next to the analytic estimate
# (docs/performance.md, "At scale"); --simulate.rank picks the rank, e.g.
#   NGPU=512 COMM_MODE=fake_backend CONFIG_FILE=train_configs/llama3_405b.toml ./run_train.sh
set -euo pipefail
cd "$(dirname "$0")"

# gpu_count: the GPUs torch sees; 0 without asking it (seconds of importing torch) when
# CUDA_VISIBLE_DEVICES is set and empty, which hides every GPU.
gpu_count() {
  if [ -n "${CUDA_VISIBLE_DEVICES+set}" ] && [ -z "$CUDA_VISIBLE_DEVICES" ]; then
    echo 0
  else
    python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0
  fi
}
if [ -z "${NGPU:-}" ]; then
  NGPU=$(gpu_count)
  [ "$NGPU" -gt 0 ] || NGPU=1
fi
CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_model.toml}
LOG_RANK=${LOG_RANK:-0}
MAX_RESTARTS_SET=${MAX_RESTARTS:-}
MAX_RESTARTS=${MAX_RESTARTS:-0}
# Expandable segments reduce fragmentation with FSDP's varying all-gather buffer sizes.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export TORCHAO_FORCE_SKIP_LOADING_SO_FILES=${TORCHAO_FORCE_SKIP_LOADING_SO_FILES:-1}
# Bad launch input ends here with one line, before anything is started.
if [ -n "${REPLICA_GROUPS:-}" ] && ! [[ "$REPLICA_GROUPS" =~ ^[1-9][0-9]*$ ]]; then
  echo "titan: error: REPLICA_GROUPS='${REPLICA_GROUPS}' is not a number of replica groups (1 or more)" >&2
  exit 2
fi
RANKS=$((NGPU * ${REPLICA_GROUPS:-1}))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / RANKS > 0 ? $(nproc) / RANKS : 1 ))}

if [ "${COMM_MODE:-}" = "fake_backend" ]; then
  exec python scripts/simulate.py --world_size "${NGPU}" --job.config_file "${CONFIG_FILE}" "$@"
elif [ -n "${COMM_MODE:-}" ]; then
  echo "titan: error: COMM_MODE='${COMM_MODE}' is not a mode titan has; valid: fake_backend (one CPU process simulates a rank of NGPU ranks), or unset" >&2
  exit 2
fi

if [ -n "${REPLICA_GROUPS:-}" ]; then
  if [ -z "${TORCHFT_LIGHTHOUSE:-}" ] && ! command -v torchft_lighthouse >/dev/null; then
    echo "titan: error: REPLICA_GROUPS needs torchft's lighthouse (torchft_lighthouse is not on PATH): pip install 'titan[ft]'" >&2
    exit 2
  fi
  # The config is checked once before the lighthouse starts (group 0's flags), and the groups'
  # folders go under its merged job.dump_folder: TOML, then flags, as the ranks read it.
  DUMP_FOLDER=$(python -m titan.launch.check --print_value job.dump_folder --world_size "${NGPU}" \
    --job.config_file "${CONFIG_FILE}" "$@" \
    --fault_tolerance.enable --fault_tolerance.group_size "${REPLICA_GROUPS}" --fault_tolerance.replica_id 0)
  GPUS=$(gpu_count)
  if [ -z "${TORCHFT_LIGHTHOUSE:-}" ]; then
    LIGHTHOUSE_PORT=${LIGHTHOUSE_PORT:-29510}
    # A quorum needs one group, so the survivors train on while a group restarts; a group that
    # stops heartbeating for half a second (5 of torchft's 100 ms heartbeats) is left out of the
    # next step's quorum (a live one that has not asked yet is waited for up to 10 s). Its
    # per-quorum INFO lines stay off the console (torchft's RUST_LOG; RUST_LOG=info brings them back).
    RUST_LOG=${RUST_LOG:-warn} torchft_lighthouse --min_replicas 1 --bind "[::]:${LIGHTHOUSE_PORT}" --join_timeout_ms 10000 \
      --heartbeat_timeout_ms 500 --quorum_tick_ms 50 &
    LIGHTHOUSE_PID=$!
    trap 'kill "$LIGHTHOUSE_PID" 2>/dev/null || true' EXIT
    export TORCHFT_LIGHTHOUSE="http://localhost:${LIGHTHOUSE_PORT}"
  fi
  pids=()
  for ((i = 0; i < REPLICA_GROUPS; i++)); do
    if [ "$GPUS" -gt 0 ]; then
      CUDA_VISIBLE_DEVICES=$(seq -s, $((i * NGPU)) $((i * NGPU + NGPU - 1)))
      export CUDA_VISIBLE_DEVICES
    fi
    python -m titan.launch --nproc_per_node="${NGPU}" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
      --max-restarts "${MAX_RESTARTS_SET:-3}" \
      --local-ranks-filter "${LOG_RANK}" --role "replica${i}_rank" --tee 3 \
      train.py --job.config_file "${CONFIG_FILE}" "$@" --fault_tolerance.enable \
      --fault_tolerance.group_size "${REPLICA_GROUPS}" --fault_tolerance.replica_id "${i}" \
      --job.dump_folder "${DUMP_FOLDER%/}/replica_${i}" &
    pids+=($!)
  done
  status=0
  for pid in "${pids[@]}"; do
    wait "$pid" || status=$?
  done
  exit "$status"
fi

# python -m titan.launch is torchrun (same options) that checks the config before any rank starts
# (a bad key: titan's line, exit 2, no traceback), passes SIGTERM / SIGINT / SIGUSR1 on to the ranks
# (each saves a checkpoint and stops; exit 0) and ends a failed run with the cause's line.
# The ranks stop if this process dies, even by kill -9. --max-restarts: torchrun's restarts, minus
# those that would fail again (a titan error) or were not wanted (a signal).
exec python -m titan.launch --nproc_per_node="${NGPU}" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
  --max-restarts "${MAX_RESTARTS}" \
  --local-ranks-filter "${LOG_RANK}" --role rank --tee 3 \
  train.py --job.config_file "${CONFIG_FILE}" "$@"
