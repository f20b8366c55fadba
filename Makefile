# Entry points for a fresh machine (see README). `make demo` trains; `make test` runs every test; `make test-quick`
# the inner loop's tier (docs/testing.md).
VENV ?= .venv
NPROC ?= 2

.PHONY: setup demo test test-quick bench wheelhouse gpu-check
setup:
	bash tools/setup.sh

# the wheels an offline GPU node needs, built here for its Python and platform (docs/gpu.md, Offline GPU nodes);
# TARGET_FREEZE: `python3 -m pip list --format=freeze` there; then `make setup PYTHON=... WHEELHOUSE=DIR` there;
# EXTRAS: pyproject's extras beside the core (default test,hf; test,hf,eval adds lm-eval)
TARGET_PYTHON ?= 3.12
TARGET_PLATFORM ?= manylinux_2_28_x86_64
wheelhouse:
	$(or $(PYTHON),python3) tools/wheelhouse.py --wheelhouse "$(WHEELHOUSE)" --freeze "$(TARGET_FREEZE)" \
	  --python-version $(TARGET_PYTHON) --platform $(TARGET_PLATFORM) $(if $(EXTRAS),--extras $(EXTRAS))

# the demo trains from step 1 every time (runs resume from their checkpoints by default); one OpenMP thread per
# process unless set, as torchrun would choose (and then print a banner about)
demo: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/torchrun --nproc_per_node $(NPROC) -m stem_megatron.train checkpoint.resume=false $(ARGS)

# two pytest-xdist workers, a module each at a time, longest first (tests/durations.json): the suite's single-process
# tests leave a core idle and its multi-process ones are 2-4 ranks (docs/testing.md); TEST_WORKERS=0 runs in one
TEST_WORKERS ?= 2
PYTEST = $(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: setup
	$(PYTEST) $(ARGS)

# every module's single-process tests and one small multi-process case a subsystem (marker `quick`), ~4 minutes
test-quick: setup
	$(PYTEST) -m "not slow or quick" $(ARGS)

bench: setup
	$(VENV)/bin/python benchmarks/ffn_cost.py

# on a GPU machine (offline with PYTHON=... WHEELHOUSE=DIR: docs/gpu.md): pre-checks in seconds (a GPU, compilers,
# Python.h, ninja, /dev/shm), the setup, the step ratios at 1B width with their audits, then the golden losses, planned
# within 7 minutes, most telling first, summary.md written after each part, all under OUT (tools/gpu_check.py, its plan
# tools/gpu_plan.py; UNTIL: a deadline in seconds since the epoch, what does not fit is left; RESUME=1: keep what an
# earlier command measured; ALL=1: the rest after, the gpu tests, the layer, the trainings, 350M and 1B's 16 layers,
# the doctor; BASELINE: an earlier run's gpu_step.json; DRY_RUN=1: the plan, each part's seconds with their source,
# without setup or GPU; OVERRIDES: Hydra overrides for every step run, e.g. host_tables.host_memory_gib=110 on a VM
# whose RAM grows as it is used)
gpu-check:
	$(or $(PYTHON),python3) tools/gpu_check.py --venv "$(VENV)" \
	  $(if $(OUT),--out "$(OUT)") $(if $(UNTIL),--until $(UNTIL)) $(if $(RESUME),--resume) $(if $(ALL),--all) \
	  $(if $(BASELINE),--baseline "$(BASELINE)") $(if $(DRY_RUN),--dry-run) $(OVERRIDES)
