#!/usr/bin/env bash
# A one-node Slurm on this machine, to try multinode_trainer.slurm on a laptop or a CI box.
#   sudo scripts/slurm_local.sh up       # install (Debian/Ubuntu) + configure + start; waits for an idle node
#   sudo scripts/slurm_local.sh status   # daemons, node state, queue (exit 1 when not up)
#   sudo scripts/slurm_local.sh down     # cancel the jobs, stop the daemons
# Idempotent and non-interactive. Needs root (the daemons, /etc/slurm). Installs slurmctld, slurmd,
# slurm-client and munge with apt-get when missing. No systemd: the daemons are started directly.
# The node is this host at 127.0.0.1 with the CPUs and memory `slurmd -C` reports, no GPUs (GRES),
# no accounting database (use `scontrol show job` / `sbatch --wait`, not sacct). A requeued job may
# start again after ~12 s (cred_expire=10, scheduler every 2 s) instead of Slurm's default 2 minutes.
set -euo pipefail

CONF=/etc/slurm/slurm.conf
MARK="# written by titan scripts/slurm_local.sh"
LOGS=/var/log/slurm
STATE=/var/lib/titan-slurm
PACKAGES=(slurmctld slurmd slurm-client munge)
NODE=$(hostname -s)

die() {
  echo "slurm_local.sh: error: $*" >&2
  for log in /var/log/munge/munged.log "$LOGS/slurmctld.log" "$LOGS/slurmd.log"; do
    if [ -s "$log" ]; then
      echo "--- last lines of $log" >&2
      tail -n 15 "$log" >&2
    fi
  done
  exit 1
}

running() {  # running <pidfile>: the daemon of that pid file is alive
  [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null; then
    return
  fi
  command -v apt-get >/dev/null || die "Slurm is not installed and apt-get is missing: install ${PACKAGES[*]} with this system's package manager"
  echo "installing ${PACKAGES[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null || die "apt-get update failed (no network or no package mirror?)"
  apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null \
    || die "apt-get install ${PACKAGES[*]} failed"
}

write_config() {
  if [ -e "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    die "$CONF exists and was not written by this script: this machine has its own Slurm set-up; not touching it"
  fi
  # The node may not claim more than slurmd sees, or it drains at registration.
  local hw cpus mem
  hw=$(slurmd -C | head -n 1)
  cpus=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$hw")
  mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
  if [ -z "$cpus" ] || [ -z "$mem" ]; then die "could not read CPUs/RealMemory from 'slurmd -C': $hw"; fi
  mkdir -p /etc/slurm "$LOGS" "$STATE/ctld" "$STATE/d"
  cat >"$CONF.new" <<EOF
$MARK: one node, no accounting, no cgroups
ClusterName=titan-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
# a requeued job may start again after 10 s instead of 120 (needs a slurmctld restart to change)
AuthInfo=cred_expire=10
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
MpiDefault=none
ReturnToService=2
KillWait=30
MinJobAge=600
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  if [ -e "$CONF" ] && cmp -s "$CONF" "$CONF.new"; then
    rm -f "$CONF.new"
    return 1  # unchanged
  fi
  mv "$CONF.new" "$CONF"
}

start_munge() {
  if running /run/munge/munged.pid; then return; fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 0755 /run/munge
  [ -s /etc/munge/munge.key ] || die "/etc/munge/munge.key is missing (reinstall the munge package or run mungekey)"
  # munged refuses to run as root; the key must be the munge user's, mode 0400
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  runuser -u munge -- /usr/sbin/munged || die "munged did not start"
}

wait_idle() {
  local state=""
  for _ in $(seq 1 60); do
    state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null | head -n 1 || true)
    case "$state" in
      idle | mixed | allocated) return ;;
      drained | draining | down | "down*") scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 1
  done
  die "node $NODE is not idle after 60 s (state: ${state:-unknown}; 'scontrol show node $NODE' says why)"
}

up() {
  [ "$(id -u)" = 0 ] || die "run as root (sudo $0 up): the Slurm daemons and /etc/slurm need it"
  install_packages
  local changed=1
  write_config || changed=0
  start_munge
  munge -n | unmunge >/dev/null 2>&1 || die "munge does not work (munge -n | unmunge failed)"
  if [ "$changed" = 1 ] && running /run/slurmctld.pid; then  # AuthInfo and the node line need a restart
    scontrol shutdown >/dev/null 2>&1 || true
    for _ in $(seq 1 20); do running /run/slurmctld.pid || running /run/slurmd.pid || break; sleep 0.5; done
  fi
  running /run/slurmctld.pid || slurmctld || die "slurmctld did not start"
  running /run/slurmd.pid || slurmd -N "$NODE" || die "slurmd did not start"
  wait_idle
  echo "slurm is up: node $NODE ($(sinfo -h -n "$NODE" -o '%c CPUs, %m MB'), partition debug); try: sbatch --wrap hostname"
}

stop_daemon() {  # stop_daemon <pidfile> <name>
  if ! running "$1"; then return; fi
  local pid
  pid=$(cat "$1")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.25; done
  echo "slurm_local.sh: $2 (pid $pid) did not stop in 10 s; killing it" >&2
  kill -9 "$pid" 2>/dev/null || true
}

down() {
  [ "$(id -u)" = 0 ] || die "run as root (sudo $0 down)"
  if running /run/slurmctld.pid && command -v squeue >/dev/null; then
    local jobs
    jobs=$(squeue -h -o %A 2>/dev/null || true)
    if [ -n "$jobs" ]; then
      # shellcheck disable=SC2086  # one job id per word
      scancel $jobs 2>/dev/null || true
      for _ in $(seq 1 60); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.5; done
    fi
  fi
  stop_daemon /run/slurmd.pid slurmd
  stop_daemon /run/slurmctld.pid slurmctld
  stop_daemon /run/munge/munged.pid munged
  echo "slurm is down"
}

status() {
  local up=1
  for d in /run/munge/munged.pid:munged /run/slurmctld.pid:slurmctld /run/slurmd.pid:slurmd; do
    if running "${d%%:*}"; then echo "${d##*:}: running (pid $(cat "${d%%:*}"))"; else echo "${d##*:}: stopped"; up=0; fi
  done
  if [ "$up" = 1 ]; then
    sinfo -N -o "%N %T %c %m"
    squeue
    return 0
  fi
  return 1
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
