#!/usr/bin/env bash
# Builds the local stand-ins of the paper's mid-training mix (recipes/data/midtrain_mix.yaml) beside the
# demo corpus and with its tokenizer: stdlib-numeric (CPython's math-heavy modules, for the 5% math
# share) and stdlib-code (the rest of the standard library, for the 30% code share). Run tools/setup.sh
# first. Idempotent: rebuilding gives the same files.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
DATA=${DATA:-data_cache/python-doc}
STDLIB=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
NUMERIC="_pydecimal.py fractions.py statistics.py numbers.py random.py"

numeric=()
for f in $NUMERIC; do numeric+=("$STDLIB/$f"); done
mapfile -t code < <(find "$STDLIB" -name '*.py' -not -path '*-packages/*' -not -path '*/test/*' -not -path '*/tests/*' -not -path '*/idle_test/*' | sort | grep -v -x -F "${numeric[@]/#/-e}")
"$VENV/bin/stem-preprocess" --tokenizer "$DATA/tokenizer.json" --output-prefix "$DATA/stdlib-numeric" --input "${numeric[@]}"
"$VENV/bin/stem-preprocess" --tokenizer "$DATA/tokenizer.json" --output-prefix "$DATA/stdlib-code" --input "${code[@]}"
