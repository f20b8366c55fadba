#!/usr/bin/env bash
# Sets up a fresh machine: Debian's python3.11-doc (the demo corpus), a venv with torch + the project,
# and the tokenized corpus. Idempotent; safe to rerun. GPU nodes get the CUDA torch build and the
# `gpu` extra (Transformer Engine); CPU machines the CPU wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

if ! dpkg -s python3.11-doc >/dev/null 2>&1; then
  SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3.11-doc >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), "stem-megatron needs Python 3.11"'
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/pip --disable-pip-version-check -q"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  $PIP install torch && $PIP install -e '.[dev,gpu]'
else
  # the CPU wheel first: an unpinned torch would pull a multi-GB CUDA build
  $PIP install torch==2.13.0 && $PIP install -e '.[dev]'
fi

"$VENV/bin/python" -m stem_megatron.data.corpus --out data_cache/python-doc
# local stand-ins of the paper's mid-training mix (data=midtrain_mix, +experiment=midtrain_1b)
[ -f data_cache/python-doc/stdlib-code.idx ] || bash tools/prepare_midtrain_mix.sh
