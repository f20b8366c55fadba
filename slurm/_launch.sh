# Shared body of the slurm/*.sh job scripts: sourced by them, not submitted itself.
#
# Launches one torchrun per node (srun, one task per node) that joins a c10d rendezvous on the first
# node and starts $NPROC training processes there: `python -m stem_megatron.train <overrides>`.
#
# From the job script: REPO (repository root), DEFAULTS (array of Hydra overrides, the recipe of
# the script), "$@" (the user's Hydra overrides, placed after DEFAULTS: for the same key Hydra keeps the
# last value, so they win).
# Environment knobs (sbatch exports the submitting shell's environment):
#   GPUS_PER_NODE    GPUs a node's processes use; default: the job's --gpus-per-node, else 8
#   NPROC            training processes per node; default GPUS_PER_NODE (required when it is 0: CPU runs)
#   VENV / PYTHON    default $REPO/.venv and $VENV/bin/python
#   OUT_DIR          run directory; default runs/slurm/<job name>-<job id> (an out_dir=... override wins)
#   EXTRA_OVERRIDES  more Hydra overrides (space-separated), placed after DEFAULTS and before "$@"
#   MASTER_PORT      rendezvous port on the first node; default 20000 + job id % 20000
#   REQUEUE          after SIGUSR1 (sbatch --signal=B:USR1@120, before the time limit) stopped training with a
#                    checkpoint: 1 (default) requeues the job, which resumes from it (see RESUME), 0 not

set -euo pipefail
: "${SLURM_JOB_ID:?not inside a SLURM job: submit with sbatch (see docs/cluster.md)}"
REPO=$(cd "$REPO" && pwd)
cd "$REPO"

# ---- processes and software ----------------------------------------------------------------------------
job_gpus=${SLURM_GPUS_PER_NODE:-}      # e.g. "8" or "h100:8"
job_gpus=${job_gpus##*:}
GPUS_PER_NODE=${GPUS_PER_NODE:-${job_gpus:-8}}
NPROC=${NPROC:-$GPUS_PER_NODE}
if [ "$NPROC" -lt 1 ]; then
  echo "error: no GPUs per node (GPUS_PER_NODE=$GPUS_PER_NODE): set NPROC=<processes per node> for a CPU run" >&2
  exit 2
fi
VENV=${VENV:-$REPO/.venv}
PYTHON=${PYTHON:-$VENV/bin/python}
if [ -f "$VENV/bin/activate" ]; then
  set +u
  # shellcheck disable=SC1091
  source "$VENV/bin/activate"
  set -u
fi
if [ ! -x "$(command -v "$PYTHON")" ]; then
  echo "error: no python at $PYTHON (run tools/setup.sh, or set VENV/PYTHON)" >&2
  exit 2
fi

# ---- environment of the training processes -------------------------------------------------------------
CPUS=${SLURM_CPUS_PER_TASK:-$(nproc)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CPUS / NPROC > 0 ? CPUS / NPROC : 1 ))}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # a hung/failed collective ends the job
# (NCCL_ASYNC_ERROR_HANDLING is the name before torch 2.2; torch 2.13 only warns about it)
# Fabric settings depend on the cluster; uncomment what yours needs:
# export NCCL_DEBUG=INFO                 # or WARN
# export NCCL_SOCKET_IFNAME=ib0          # NCCL bootstrap/socket interface (ib0, eth0, ^lo,docker, ...)
# export NCCL_IB_HCA=mlx5                # InfiniBand adapters to use
# export NCCL_IB_GID_INDEX=3             # RoCE
# export NCCL_IB_DISABLE=1               # no InfiniBand: TCP sockets only
# export NCCL_NET_GDR_LEVEL=PHB          # GPUDirect RDMA distance
# export NCCL_IB_TIMEOUT=22
# gloo (megatron's host-side groups, the STEM tables' node groups) uses the interface its hostname resolves to
# unless GLOO_SOCKET_IFNAME names some (comma-separated). NCCL_SOCKET_IFNAME is mirrored when it lists this node's
# interfaces; its prefix and ^exclusion forms (ib, ^lo,docker) mean nothing to gloo: set GLOO_SOCKET_IFNAME then.
if [ -z "${GLOO_SOCKET_IFNAME:-}" ] && [ -n "${NCCL_SOCKET_IFNAME:-}" ]; then
  gloo_ifs=$NCCL_SOCKET_IFNAME
  for i in ${NCCL_SOCKET_IFNAME//,/ }; do [ -e "/sys/class/net/$i" ] || gloo_ifs=""; done
  if [ -n "$gloo_ifs" ]; then
    export GLOO_SOCKET_IFNAME=$gloo_ifs
  else
    echo "note: NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME names no interfaces of $(hostname) as such:" \
         "gloo keeps its default; set GLOO_SOCKET_IFNAME=<interface> if its groups hang" >&2
  fi
fi
export PYTHONUNBUFFERED=1
# JIT-built ops (DeepSpeed's CPU Adam for the host tables) per venv, where the package builds and finds them
# (row_optimizer.extensions_root), named here for the lock clean-up below.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}
# A job killed while such an op compiles (requeue, scancel, time limit) leaves the build's lock file behind
# and every later run waits on it forever: drop locks older than 30 minutes (a build takes a few).
find "$TORCH_EXTENSIONS_DIR" -name lock -mmin +30 -print -delete 2>/dev/null | sed 's/^/removed stale lock /' || true

# ---- Hydra overrides ----------------------------------------------------------------------------------
read -r -a extra <<< "${EXTRA_OVERRIDES:-}"
OVERRIDES=("${DEFAULTS[@]}" "${extra[@]}" "$@")
user_out_dir=""
for o in "${OVERRIDES[@]}"; do
  case "$o" in out_dir=*|+out_dir=*|++out_dir=*) user_out_dir=${o#*out_dir=} ;; esac
done
if [ -n "$user_out_dir" ]; then
  OUT_DIR=$user_out_dir
else
  if [ -n "${SLURM_ARRAY_JOB_ID:-}" ]; then tag=${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}; else tag=$SLURM_JOB_ID; fi
  OUT_DIR=${OUT_DIR:-runs/slurm/${SLURM_JOB_NAME}-$tag}
  OVERRIDES+=("out_dir=$OUT_DIR")
fi

# ---- GPUs: checked before srun -----------------------------------------------------------------------------
# torch must see them (a venv set up on the login node has CPU torch: job_start names the fix). The run's
# tensor-parallel size, from its config composed as stem-train does (recipe + overrides; a misspelt override fails
# here), decides CUDA_DEVICE_MAX_CONNECTIONS=1: one hardware queue, so that megatron's TP / sequence-parallel
# communication overlaps compute in issue order. At TP=1 nothing needs it, and it would serialise the STEM prefetch
# side-stream copies with compute.
if [ "$GPUS_PER_NODE" -gt 0 ]; then
  TP=$("$PYTHON" -m stem_megatron.doctor.job_start "$NPROC" "${OVERRIDES[@]}") || exit 2
  if [ "$TP" -gt 1 ]; then export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}; fi
fi

# ==== RESUME ==============================================================================================
# A requeued job (time limit, node failure, preemption) runs this script again with the same job id, hence
# the same OUT_DIR, and SLURM_RESTART_COUNT > 0. The run resumes by itself from $OUT_DIR/checkpoints/latest
# (checkpoint.resume=true is the default; set checkpoint.save_interval so little is lost): model, both
# optimizers, LR schedule, data position and RNG continue exactly. metrics.jsonl keeps the steps up to the
# checkpoint; the earlier attempt's complete file is copied to metrics.attempt<N>.jsonl first.
if [ -e "$OUT_DIR/checkpoints/latest" ]; then
  echo "resuming from $OUT_DIR/checkpoints/$(cat "$OUT_DIR/checkpoints/latest")"
fi
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && [ -f "$OUT_DIR/metrics.jsonl" ]; then
  cp "$OUT_DIR/metrics.jsonl" "$OUT_DIR/metrics.attempt$(( SLURM_RESTART_COUNT - 1 )).jsonl"
fi
# =========================================================================================================

# ---- stop and requeue shortly before the time limit --------------------------------------------------------
# SIGUSR1 (--signal=B:USR1@120) goes on to the training processes through srun and torchrun: they finish the step,
# save a checkpoint and leave $OUT_DIR/stopped.json (training/preemption.py). Once srun has ended, a stopped run is
# requeued and resumes from that checkpoint with no step redone; a run that finished or failed meanwhile is not.
# SIGTERM (preemption, scancel, the time limit itself) reaches them from SLURM and ends the same way, without a requeue
# from here (a preempted job is requeued by SLURM itself when the cluster preempts by requeueing).
stop_requested=0
requeue() {
  if [ "${REQUEUE:-1}" = 1 ]; then
    echo "$(date '+%F %T') requeueing job $SLURM_JOB_ID (restart $(( ${SLURM_RESTART_COUNT:-0} + 1 )))"
    scontrol requeue "$SLURM_JOB_ID"
  else
    echo "$(date '+%F %T') not requeueing (REQUEUE=0)"
  fi
}
# shellcheck disable=SC2329  # called by the trap
stop_training() {
  stop_requested=1
  if [ -n "${srun_pid:-}" ]; then
    echo "$(date '+%F %T') SIGUSR1 (time limit near): training stops after its step, with a checkpoint"
    kill -USR1 "$srun_pid" 2>/dev/null || true
  else  # not started yet: nothing to save
    requeue
  fi
}
trap stop_training USR1

# ---- launch -----------------------------------------------------------------------------------------------
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
MASTER_PORT=${MASTER_PORT:-$(( 20000 + SLURM_JOB_ID % 20000 ))}
NNODES=${SLURM_NNODES:-1}
cmd=("$PYTHON" -m stem_megatron.torchrun
     --nnodes "$NNODES" --nproc_per_node "$NPROC"
     --rdzv_id "$SLURM_JOB_ID" --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT"
     -m stem_megatron.train "${OVERRIDES[@]}")
echo "job $SLURM_JOB_ID (${SLURM_JOB_NAME:-}) restart ${SLURM_RESTART_COUNT:-0}:" \
     "$NNODES node(s) [$SLURM_JOB_NODELIST] x $NPROC processes, $CPUS CPUs/node," \
     "OMP_NUM_THREADS=$OMP_NUM_THREADS, out_dir $OUT_DIR"
echo "srun: ${cmd[*]}"
# srun (22.05+) does not inherit --cpus-per-task from the job: pass it. In the background, so that the
# USR1 trap runs while training does (bash runs traps only between commands, and `wait` is one).
srun --nodes="$NNODES" --ntasks-per-node=1 --ntasks="$NNODES" --cpus-per-task="$CPUS" --kill-on-bad-exit=1 \
     "${cmd[@]}" &
srun_pid=$!
while :; do
  rc=0
  wait "$srun_pid" || rc=$?
  kill -0 "$srun_pid" 2>/dev/null || break  # otherwise `wait` was cut short by the trap: keep waiting
done
echo "$(date '+%F %T') training exited with status $rc"
if [ "$stop_requested" = 1 ] && [ -f "$OUT_DIR/stopped.json" ]; then
  requeue
fi
exit "$rc"
