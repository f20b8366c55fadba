#!/bin/bash
# The replacement-ratio sweep: one array task per ratio, the same model/data/schedule otherwise.
#   task 0: variant=dense (ratio 0)   1: stem_1_3 (1/3)   2: stem_1_2 (1/2)   3: stem_full (every layer)
# Submit from the repository root (logs/ must exist):
#   mkdir -p logs && sbatch slurm/sweep_ratio.sh [hydra overrides for every task...]
#   sbatch --array=1,3 slurm/sweep_ratio.sh train.steps=5000     # a subset of the ratios
#   sbatch --array=0-3%2 slurm/sweep_ratio.sh                     # at most 2 tasks at a time
# Runs go to $SWEEP_DIR/<variant>, SWEEP_DIR=runs/sweep_ratio-<array job id> by default (an out_dir=
# override is refused: every task would share it). SWEEP_VARIANTS="dense stem_1_3 ..." replaces the
# list (task i runs its i-th entry). Other knobs: slurm/_launch.sh. The Hydra multirun alternative
# (submitit launcher, recipes/hydra/launcher/slurm.yaml) is described in docs/cluster.md.
#SBATCH --job-name=sweep_ratio
#SBATCH --array=0-3
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=logs/%x-%A_%a.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR1@120

read -r -a VARIANTS <<< "${SWEEP_VARIANTS:-dense stem_1_3 stem_1_2 stem_full}"
TASK=${SLURM_ARRAY_TASK_ID:?submit as an array job (#SBATCH --array, or sbatch --array=...)}
if [ "$TASK" -ge "${#VARIANTS[@]}" ]; then
  echo "error: array task $TASK but only ${#VARIANTS[@]} variants: ${VARIANTS[*]}" >&2
  exit 2
fi
VARIANT=${VARIANTS[$TASK]}
for arg in "$@"; do
  case "$arg" in
    *out_dir=*) echo "error: every task would write to $arg; set SWEEP_DIR=<dir> instead" >&2; exit 2 ;;
  esac
done
OUT_DIR=${SWEEP_DIR:-runs/sweep_ratio-${SLURM_ARRAY_JOB_ID}}/$VARIANT
# Recipe: the paper's 350M run (recipes/experiment/pretrain_350m.yaml: data parallel, global batch 512 x 2048)
# on one 8-GPU node per ratio. Command-line overrides win (they apply to every task).
DEFAULTS=(+experiment=pretrain_350m "variant=$VARIANT")

# sbatch runs a copy of this script: find the repository (STEM_REPO, the submit directory, or the
# directory of the submitted script) and hand over to the shared launcher.
submitted=$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p' | head -n1)
candidates=("${STEM_REPO:-}" "${SLURM_SUBMIT_DIR:-}" "$(dirname "${submitted:-.}")/.." "$(dirname "$0")/.." "")
for REPO in "${candidates[@]}"; do [ -f "$REPO/slurm/_launch.sh" ] && break; done
source "${REPO:?cannot find the repository: set STEM_REPO=/path/to/repo}/slurm/_launch.sh"
