#!/usr/bin/env bash
# Sets up a machine: Debian's python3.11-doc (the demo corpus), a venv with torch + the project, DeepSpeed's CPU
# Adam op built into the venv, and the tokenized corpus. Idempotent; safe to rerun.
#
# STEM_DEVICE picks the torch build: cpu (the CPU wheel), gpu (CUDA torch + Transformer Engine compiled against it),
# auto (default: gpu when nvidia-smi lists a GPU on the machine running this). On a cluster the login node has no
# GPU: run it on a compute node, `srun -N1 --gpus-per-node=1 make setup STEM_DEVICE=gpu` (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0

case "${STEM_DEVICE:-auto}" in
  cpu|gpu) device=$STEM_DEVICE ;;
  auto) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then device=gpu; else device=cpu; fi
        if [ "$device" = cpu ] && [ ! -x "$VENV/bin/python" ] && command -v srun >/dev/null 2>&1; then
          echo "note: no GPU on $(hostname), installing CPU torch; for GPU jobs set up on a compute node:" \
               "srun -N1 --gpus-per-node=1 make setup STEM_DEVICE=gpu (docs/gpu.md)" >&2
        fi ;;
  *) echo "error: STEM_DEVICE=$STEM_DEVICE: use auto, cpu or gpu" >&2; exit 2 ;;
esac

# the demo corpus's source; a node without apt-get (e.g. a RHEL cluster) skips the demo corpus
demo_corpus=true
if [ ! -f data_cache/python-doc/READY ] && ! dpkg -s python3.11-doc >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3.11-doc >/dev/null
  else
    echo "note: no apt-get for python3.11-doc: skipping the demo corpus (copy data_cache/python-doc here)" >&2
    demo_corpus=false
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), "stem-megatron needs Python 3.11"'
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/pip --disable-pip-version-check -q"
if [ "$device" = gpu ]; then
  # CUDA torch, replacing a CPU build an earlier setup installed (pip counts 2.13.0+cpu as 2.13.0);
  # TORCH_INDEX_URL picks its CUDA version, e.g. https://download.pytorch.org/whl/cu126 for an older driver
  "$VENV/bin/python" -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null \
    || $PIP install --force-reinstall "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  $PIP install -e '.[dev]' 'setuptools>=68'
  # Transformer Engine, the gpu extra (megatron-core 0.16.1's version range): its PyTorch extension compiles
  # against the torch above, hence no build isolation (needs nvcc of torch's CUDA on PATH or in CUDA_HOME), with
  # the core library built for the same CUDA major version
  cuda_major=$("$VENV/bin/python" -c 'import torch; print(torch.version.cuda.split(".")[0])')
  $PIP install --no-build-isolation -e '.[gpu]' "transformer-engine[core_cu$cuda_major]"
else
  # the CPU wheel first: an unpinned torch would pull a multi-GB CUDA build
  $PIP install "torch==$TORCH_VERSION" && $PIP install -e '.[dev]'
fi

# DeepSpeed's CPU Adam (the host tables' optimizer) compiles on first use, for minutes: build it now, where the
# Makefile and slurm/_launch.sh look for it
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$(cd "$VENV" && pwd)/torch_extensions}
"$VENV/bin/python" -W ignore -c 'from stem_megatron.host_tables.row_adam import RowAdam; RowAdam((0.9, 0.95), 1e-8, 0)'

if $demo_corpus; then
  "$VENV/bin/python" -m stem_megatron.data.corpus --out data_cache/python-doc
  # local stand-ins of the paper's mid-training mix (data=midtrain_mix, +experiment=midtrain_1b)
  [ -f data_cache/python-doc/stdlib-code.idx ] || bash tools/prepare_midtrain_mix.sh
fi
