# Entry points for a fresh machine (see README). `make demo` trains; `make test` runs every test.
VENV ?= .venv
# one DeepSpeed op build per venv (a shared ~/.cache build is rebuilt whenever venvs alternate)
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions
NPROC ?= 2

.PHONY: setup demo test bench
setup:
	bash tools/setup.sh

# the demo trains from step 1 every time (runs resume from their checkpoints by default); one OpenMP thread per
# process unless set, as torchrun would choose (and then print a banner about)
demo: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/torchrun --nproc_per_node $(NPROC) -m stem_megatron.train checkpoint.resume=false $(ARGS)

test: setup
	$(VENV)/bin/python -m pytest -q $(ARGS)

bench: setup
	$(VENV)/bin/python benchmarks/ffn_cost.py
