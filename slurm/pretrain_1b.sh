#!/bin/bash
# Pretrain Llama-3.2-1B with STEM-1/3 (a third of the FFN layers replaced) on GPU nodes, one torchrun per
# node. Submit from the repository root (logs/ must exist: sbatch does not create it):
#   mkdir -p logs && sbatch slurm/pretrain_1b.sh [hydra overrides...]
#   sbatch --nodes=16 slurm/pretrain_1b.sh variant=stem_full data.dir=/path/to/corpus
# CPU smoke test on one node without GPUs (see docs/cluster.md):
#   NPROC=2 sbatch --nodes=1 --gpus-per-node=0 --cpus-per-task=2 slurm/pretrain_1b.sh \
#       model=tiny parallel=tp2 model.seq_length=128 train.steps=3 train.log_interval=1 ...
# Knobs (GPUS_PER_NODE, NPROC, VENV, PYTHON, OUT_DIR, EXTRA_OVERRIDES, MASTER_PORT, REQUEUE): slurm/_launch.sh.
#SBATCH --job-name=pretrain_1b
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR1@120

# Recipe: the paper's Table 2 run, recipes/experiment/pretrain_1b.yaml (llama3.2_1b; TP=1 PP=1, so every GPU
# is a data-parallel rank; global batch 512), with STEM-1/3. Command-line overrides win.
DEFAULTS=(+experiment=pretrain_1b variant=stem_1_3)

# sbatch runs a copy of this script: find the repository (STEM_REPO, the submit directory, or the
# directory of the submitted script) and hand over to the shared launcher.
submitted=$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p' | head -n1)
candidates=("${STEM_REPO:-}" "${SLURM_SUBMIT_DIR:-}" "$(dirname "${submitted:-.}")/.." "$(dirname "$0")/.." "")
for REPO in "${candidates[@]}"; do [ -f "$REPO/slurm/_launch.sh" ] && break; done
source "${REPO:?cannot find the repository: set STEM_REPO=/path/to/repo}/slurm/_launch.sh"
