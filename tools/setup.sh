#!/usr/bin/env bash
# Sets up a machine: Debian's python3.11-doc (the demo corpus), a Python >= 3.12 venv with torch + the project and all
# its extras, DeepSpeed's CPU Adam op built into the venv, and the tokenized corpus. Idempotent; safe to rerun.
#
# STEM_DEVICE picks the torch build: cpu (no Transformer Engine), gpu (CUDA torch + TE compiled against it),
# auto (default: gpu when nvidia-smi lists a GPU on the machine running this). On a cluster the login node has no
# GPU: run it on a compute node, `srun -N1 --gpus-per-node=1 make setup STEM_DEVICE=gpu` (docs/gpu.md).
#
# A PYTHON that already has torch (an NGC container's, a prepared venv such as /opt/torch/.venv): the venv is made on
# top of its packages and reuses its torch, Transformer Engine and Apex, pinned for every pip call, never installed.
# WHEELHOUSE=DIR (built by `make wheelhouse` on a machine with a registry): installs offline, from DIR alone, the
# core requirements and the extras it was built with (pytest, transformers; docs/gpu.md, Offline GPU nodes).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TORCH_VERSION=2.13.0
WHEELHOUSE=${WHEELHOUSE:-}
if [ -n "$WHEELHOUSE" ]; then
  if [ ! -f "$WHEELHOUSE/wheelhouse.txt" ]; then
    echo "error: WHEELHOUSE=$WHEELHOUSE holds no wheelhouse: build one with \`make wheelhouse WHEELHOUSE=DIR" \
         "TARGET_FREEZE=FILE\` where pip reaches an index and carry DIR here (docs/gpu.md)" >&2
    exit 2
  fi
  WHEELHOUSE=$(cd "$WHEELHOUSE" && pwd)
fi

# a Python >= 3.12 (megatron-core 0.19 needs it): $PYTHON, else python3.12/3.13/python3 on PATH, else one that pyenv
# has installed but not selected (its python3.12 shim on PATH then refuses to run)
new_enough() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }
find_python() {
  local candidate
  for candidate in ${PYTHON:-} python3.12 python3.13 python3; do
    if new_enough "$candidate"; then command -v "$candidate"; return; fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for candidate in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9]|[2-9][0-9])(\.[0-9]+)?$'); do
      if new_enough "$(pyenv root)/versions/$candidate/bin/python3"; then
        echo "$(pyenv root)/versions/$candidate/bin/python3"; return
      fi
    done
  fi
  echo "error: stem-megatron needs Python >= 3.12 (megatron-core 0.19); none found: install python3.12, or set" \
       "PYTHON=/path/to/python3.12" >&2
  exit 2
}

case "${STEM_DEVICE:-auto}" in
  cpu|gpu) device=$STEM_DEVICE ;;
  auto) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then device=gpu; else device=cpu; fi
        ;;
  *) echo "error: STEM_DEVICE=$STEM_DEVICE: use auto, cpu or gpu" >&2; exit 2 ;;
esac

# the demo corpus's source; a node without apt-get (e.g. a RHEL cluster), or offline, skips the demo corpus
demo_corpus=true
if [ ! -f data_cache/python-doc/READY ] && ! dpkg -s python3.11-doc >/dev/null 2>&1; then
  if [ -n "$WHEELHOUSE" ]; then
    echo "note: offline (WHEELHOUSE), no python3.11-doc: skipping the demo corpus (copy data_cache/python-doc here)" >&2
    demo_corpus=false
  elif command -v apt-get >/dev/null 2>&1; then
    SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3.11-doc >/dev/null
  else
    echo "note: no apt-get for python3.11-doc: skipping the demo corpus (copy data_cache/python-doc here)" >&2
    demo_corpus=false
  fi
fi

if [ -x "$VENV/bin/python" ] && ! new_enough "$VENV/bin/python"; then
  echo "note: $VENV has Python $("$VENV/bin/python" -c 'import platform; print(platform.python_version())'); making" \
       "it anew with Python >= 3.12 (megatron-core 0.19)" >&2
  rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
  python=$(find_python)
  if "$python" -s -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)' 2>/dev/null; then
    "$python" -m venv --system-site-packages "$VENV"
    # venvs do not chain: one made from a venv sees its base interpreter's packages, so a .pth names that venv's
    own=$("$python" -c 'import site, sys; sys.prefix != sys.base_prefix and print("\n".join(site.getsitepackages()))')
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    [ -z "$own" ] || echo "$own" > "$site/_stem_layered_on.pth"
  else
    if [ "${STEM_DEVICE:-auto}" = auto ] && [ "$device" = cpu ] && command -v srun >/dev/null 2>&1; then
      echo "note: no GPU on $(hostname), installing CPU torch; for GPU jobs set up on a compute node:" \
           "srun -N1 --gpus-per-node=1 make setup STEM_DEVICE=gpu (docs/gpu.md)" >&2
    fi
    "$python" -m venv "$VENV"
  fi
fi
# what the venv reuses from the environment it was layered on (torch, TE, Apex), pinned: pip keeps them as they are
constraints=$VENV/constraints.txt
"$VENV/bin/python" -m stem_megatron.doctor.layered "$constraints"
layered=false
if [ -f "$constraints" ]; then
  layered=true
  # later pip calls in the venv keep them too (`pip install -e '.[eval]'`)
  printf '[install]\nconstraint = %s\n' "$(cd "$VENV" && pwd)/constraints.txt" > "$VENV/pip.conf"
fi
# pip -q, less one harmless line a name: a machine whose pip.conf lists local indexes (extra-index-url file://...)
# warns for every project one of them lacks, 160 lines a fresh setup
quiet_pip() {
  "$VENV/bin/pip" --disable-pip-version-check -q "$@" \
    2> >(grep -v "^WARNING: Location 'file://.*' is ignored: it is neither a file nor a directory\.$" >&2 || true)
}
PIP=quiet_pip
index=(); [ -z "$WHEELHOUSE" ] || index=(--no-index --find-links "$WHEELHOUSE")
pins=(); ! $layered || pins=(-c "$constraints")
pip_install() { $PIP install "${index[@]}" "${pins[@]}" "$@"; }
if [ -n "$WHEELHOUSE" ]; then
  # offline: the core requirements and the extras the wheelhouse was built with (wheelhouse.txt), whatever the
  # environment lacks coming from the wheelhouse (torch too where the environment has none); the editable build uses
  # the setuptools there, as pip cannot fetch one
  extras=$(sed -n 's/^# extras: //p' "$WHEELHOUSE/wheelhouse.txt"); extras=${extras:-test}
  pip_install 'setuptools>=68'
  pip_install --no-build-isolation -e ".[$extras]"
elif $layered; then
  pip_install -e '.[dev]'
elif [ "$device" = gpu ]; then
  # CUDA torch, replacing a CPU build an earlier setup installed (pip counts 2.13.0+cpu as 2.13.0);
  # TORCH_INDEX_URL picks its CUDA version, e.g. https://download.pytorch.org/whl/cu126 for an older driver
  "$VENV/bin/python" -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null \
    || $PIP install --force-reinstall "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  $PIP install -e '.[dev]' 'setuptools>=68'
  # Transformer Engine, the gpu extra (its version range: pyproject.toml): its PyTorch extension compiles
  # against the torch above, hence no build isolation (needs nvcc of torch's CUDA on PATH or in CUDA_HOME), with
  # the core library built for the same CUDA major version
  cuda_major=$("$VENV/bin/python" -c 'import torch; print(torch.version.cuda.split(".")[0])')
  $PIP install --no-build-isolation -e '.[gpu]' "transformer-engine[core_cu$cuda_major]"
else
  # torch pinned first, so that the project's open torch requirement takes it. A CPU wheel where the index has one
  # (TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu, or a local one); PyPI's Linux wheel is the CUDA build,
  # several GB with its CUDA libraries, which runs on a machine without a GPU as well
  $PIP install "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} && $PIP install -e '.[dev]'
fi

# DeepSpeed's CPU Adam (the host tables' optimizer) and the lean tables' update compile on first use, for minutes:
# build them now, into the venv's torch_extensions, where every process of the venv looks (row_optimizer.extensions_root)
"$VENV/bin/python" -W ignore -c 'from stem_megatron.host_tables.row_optimizer import RowAdam, lean_kernel
RowAdam((0.9, 0.95), 1e-8, 0); lean_kernel()'

if $demo_corpus; then
  "$VENV/bin/python" -m stem_megatron.data.corpus --out data_cache/python-doc
  # local stand-ins of the paper's mid-training mix (data=midtrain_mix, +experiment=midtrain_1b)
  [ -f data_cache/python-doc/stdlib-code.idx ] || bash tools/prepare_midtrain_mix.sh
fi
