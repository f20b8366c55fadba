# Entry points for a fresh machine (see README). `make demo` trains; `make test` runs every test.
VENV ?= .venv
# one DeepSpeed op build per venv (a shared ~/.cache build is rebuilt whenever venvs alternate)
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions
NPROC ?= 2

.PHONY: setup demo test bench wheelhouse gpu-check
setup:
	bash tools/setup.sh

# the wheels an offline GPU node needs, built here for its Python and platform (docs/gpu.md, Offline GPU nodes);
# TARGET_FREEZE: `python3 -m pip list --format=freeze` there; then `make setup PYTHON=... WHEELHOUSE=DIR` there
TARGET_PYTHON ?= 3.12
TARGET_PLATFORM ?= manylinux_2_28_x86_64
wheelhouse:
	$(or $(PYTHON),python3) tools/wheelhouse.py --wheelhouse "$(WHEELHOUSE)" --freeze "$(TARGET_FREEZE)" \
	  --python-version $(TARGET_PYTHON) --platform $(TARGET_PLATFORM)

# the demo trains from step 1 every time (runs resume from their checkpoints by default); one OpenMP thread per
# process unless set, as torchrun would choose (and then print a banner about)
demo: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/torchrun --nproc_per_node $(NPROC) -m stem_megatron.train checkpoint.resume=false $(ARGS)

test: setup
	$(VENV)/bin/python -m pytest -q $(ARGS)

bench: setup
	$(VENV)/bin/python benchmarks/ffn_cost.py

# on a GPU machine (set up first, offline with PYTHON=... WHEELHOUSE=DIR: docs/gpu.md): the gpu tests, the 1B/350M
# step benchmark with its audits, the layer benchmark and the doctor, most telling first, and the figures against
# the GPU step's goals, all under OUT (tools/gpu_check.py; UNTIL: a deadline in seconds since the epoch, what does
# not fit is left; RESUME=1: keep what an earlier command measured; BASELINE: an earlier run's gpu_step.json)
gpu-check: setup
	$(VENV)/bin/python tools/gpu_check.py $(if $(OUT),--out "$(OUT)") $(if $(UNTIL),--until $(UNTIL)) \
	  $(if $(RESUME),--resume) $(if $(BASELINE),--baseline "$(BASELINE)")
