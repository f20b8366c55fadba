#!/usr/bin/env bash
# Installs and starts a one-node SLURM cluster on this machine (controller + compute node = this host),
# for the sbatch smoke test (tests/test_slurm.py) and CI. Debian/Ubuntu, run as root (re-runs itself
# with sudo otherwise); works without systemd (the daemons are started directly).
#
# Idempotent: packages are installed once, the munge key is created once, slurm.conf is rewritten only
# when its content changes (then the slurm daemons are restarted), running daemons are left alone.
# Ends when `sinfo` shows the node idle (or fails after $SLURM_LOCAL_TIMEOUT seconds, default 60).
#
#   bash tools/slurm_local.sh            # then: sinfo; sbatch ...
#   SLURM_LOCAL_CPUS=2 bash tools/slurm_local.sh   # advertise fewer CPUs than nproc
set -euo pipefail
if [ "$(id -u)" != 0 ]; then exec sudo -E bash "$0" "$@"; fi

HOST=$(hostname -s)
# (nproc obeys OMP_NUM_THREADS, which test runners set to 1)
CPUS=${SLURM_LOCAL_CPUS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
# advertise 90% of the memory (MB) so slurmd's own check (RealMemory <= physical) always passes
MEM_MB=${SLURM_LOCAL_MEM_MB:-$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)}
PARTITION=${SLURM_LOCAL_PARTITION:-local}
TIMEOUT=${SLURM_LOCAL_TIMEOUT:-60}
CONF=/etc/slurm/slurm.conf
LOGDIR=/var/log/slurm
log() { echo "slurm_local: $*"; }

# ---- packages ----------------------------------------------------------------------------------------
missing=0
for cmd in slurmctld slurmd sbatch munged; do
  command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || missing=1
done
if [ "$missing" = 1 ]; then
  log "installing slurm-wlm and munge (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # policy-rc.d 101: postinst scripts must not start daemons (no init system here; we start them below)
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
  rm -f /usr/sbin/policy-rc.d
  trap - EXIT
fi
export PATH=/usr/sbin:/usr/bin:$PATH

# ---- munge -------------------------------------------------------------------------------------------
mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
if [ ! -s /etc/munge/munge.key ]; then
  log "creating /etc/munge/munge.key"
  if command -v mungekey >/dev/null 2>&1; then
    mungekey --create --keyfile=/etc/munge/munge.key
  else
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
fi
chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge
chmod 0700 /etc/munge /var/lib/munge /var/log/munge
chmod 0755 /run/munge
chmod 0400 /etc/munge/munge.key
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
  log "starting munged"
  rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
  runuser -u munge -- munged
  for _ in $(seq 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.2; done
  munge -n </dev/null | unmunge >/dev/null || { log "munged does not answer"; exit 1; }
fi

# ---- slurm.conf --------------------------------------------------------------------------------------
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd "$LOGDIR"
new_conf=$(cat <<EOF
# Written by tools/slurm_local.sh: one node (this host) is both controller and compute node.
ClusterName=local
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
# no cgroups: processes tracked through /proc, no CPU binding (works in containers)
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# a node that went away (machine restarted) comes back by itself
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=60
# finished jobs stay visible to scontrol for 10 minutes (there is no accounting database)
MinJobAge=600
KillWait=10
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=$PARTITION Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
)
restart=0
if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$new_conf" ]; then
  log "writing $CONF ($HOST: $CPUS CPUs, $MEM_MB MB)"
  printf '%s\n' "$new_conf" > "$CONF"
  restart=1
fi

# ---- daemons -----------------------------------------------------------------------------------------
running() {  # running <pidfile> <comm>: the pid file names a live process of that command
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]
}
stop() {  # stop <pidfile> <comm>: only the process named in our pid file
  if running "$1" "$2"; then
    local pid; pid=$(cat "$1")
    log "stopping $2 (pid $pid)"
    kill "$pid"
    for _ in $(seq 50); do [ -d "/proc/$pid" ] || break; sleep 0.2; done
  fi
}
if [ "$restart" = 1 ]; then
  stop /run/slurmd.pid slurmd
  stop /run/slurmctld.pid slurmctld
fi
if ! running /run/slurmctld.pid slurmctld; then
  log "starting slurmctld"
  slurmctld
fi
if ! running /run/slurmd.pid slurmd; then
  log "starting slurmd"
  slurmd
fi

# ---- wait until the node takes jobs ------------------------------------------------------------------
state=""
for i in $(seq $((TIMEOUT * 2))); do
  state=$(sinfo -h -n "$HOST" -o %t 2>/dev/null | head -n1 || true)
  case "$state" in
    idle|mix|alloc|comp) break ;;
    down*|drain*|drng*|fail*)  # left over from an earlier run: resume it (ReturnToService does the rest)
      [ $((i % 10)) = 1 ] && scontrol update NodeName="$HOST" State=RESUME >/dev/null 2>&1 || true ;;
  esac
  sleep 0.5
done
case "$state" in
  idle|mix|alloc|comp) log "node $HOST is $state (partition $PARTITION)"; sinfo ;;
  *)
    log "node $HOST did not become idle within ${TIMEOUT}s (state: '${state:-none}'); last log lines:"
    tail -n 20 "$LOGDIR/slurmctld.log" "$LOGDIR/slurmd.log" 2>/dev/null || true
    exit 1 ;;
esac
