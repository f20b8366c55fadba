#!/bin/bash
# Tokenize a corpus as a SLURM array: task I of N takes the I-th share of the input files (by bytes) and writes
# PREFIX-0000I-of-0000N with every CPU of its allocation (stem-preprocess --shard I/N, from SLURM_ARRAY_TASK_ID and
# SLURM_ARRAY_TASK_COUNT; --workers from the task's CPUs). Resubmitting the array after a failure or a kill redoes
# only what is missing; a finished shard is left as it is. Then join the shards into PREFIX (--merge), or blend them
# as they are (data.blend=[[1, "PREFIX-*"]]). Submit from the repository root (logs/ must exist):
#   mkdir -p logs
#   sbatch --array=0-63 slurm/preprocess.sh --input /data/dclm --output-prefix /data/tok/dclm \
#       --tokenizer /data/tok/tokenizer.json
#   sbatch --dependency=afterok:<array job id> slurm/preprocess.sh --merge --output-prefix /data/tok/dclm
# Without --array the job tokenizes the whole input. Arguments are stem-preprocess's (docs/running.md, Data).
# Knobs: VENV / PYTHON (default $REPO/.venv and $VENV/bin/python).
#SBATCH --job-name=preprocess
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append

set -euo pipefail
# sbatch runs a copy of this script: find the repository (STEM_REPO, the submit directory, or the directory of the
# submitted script)
submitted=$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p' | head -n1)
candidates=("${STEM_REPO:-}" "${SLURM_SUBMIT_DIR:-}" "$(dirname "${submitted:-.}")/.." "$(dirname "$0")/.." "")
for REPO in "${candidates[@]}"; do [ -f "$REPO/slurm/_launch.sh" ] && break; done
REPO=$(cd "${REPO:?cannot find the repository: set STEM_REPO=/path/to/repo}" && pwd)
VENV=${VENV:-$REPO/.venv}
PYTHON=${PYTHON:-$VENV/bin/python}
echo "preprocess: task ${SLURM_ARRAY_TASK_ID:-0} of ${SLURM_ARRAY_TASK_COUNT:-1} on $(hostname -s)," \
     "${SLURM_CPUS_PER_TASK:-$(nproc)} CPUs: $PYTHON -m stem_megatron.data.preprocess $*"
exec "$PYTHON" -m stem_megatron.data.preprocess "$@"
