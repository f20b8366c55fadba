"""``make gpu-check``'s plan: its parts in the order of what they tell, and each part's seconds from measured figures,
with the arithmetic shown (``--dry-run`` prints it). Stdlib only: any Python prints the plan, before any setup.

The figures (one H100, 16 cores, the first lent GPU run; docs/gpu.md "A lent GPU"):
- a step run's start: ~23 s (torchrun, the imports, the first step);
- a 1B table (128,256 x 8,192 fp32 rows and two moments, drawn and mapped into /dev/shm): ~16 s, so ~15 s a billion
  table parameters;
- a working set adds its STEM layer's first compile: 10-40 s, planned at 25;
- a 1B-3L step ~0.7 s (6 steps of 3 layers ~4 s), a 1B step ~3.3 s (6 steps ~20 s), a 350M step ~2 s (the GPU kit's
  table: 1.5-2.0 s);
- the recipe's dense row Adam moves ~28 bytes a table parameter a step at ~100 GB/s: ~0.28 s a billion a step;
- setup offline: pip from the wheelhouse ~40 s (35 wheels in ~30 s, plus transformers), the row-Adam op build 65 s;
- the seven GPU-only tests: 110-150 s, planned at 130;
- the golden losses: a start for the CPU jobs that write the starting weights, one for the three GPU runs side by
  side, 30 steps of the tiny model (~0.05 s a step), and the working set's compile.
``summary.md`` sets each part's seconds beside its plan: correct these from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from stem_megatron.layer_plan import stem_layer_indices  # stdlib only

BUDGET_S = 420  # the default plan, setup included: 7 of a lent machine's 15 minutes
START_S = 23  # a step run's torchrun, imports and first step
TABLE_S_PER_G = 16 / (128256 * 8192 / 1e9)  # a 1B table in ~16 s
COMPILE_S = 25  # the working set's STEM layer's first compile (10-40 s)
DENSE_ADAM_S_PER_G = 28 / 100  # 28 bytes a table parameter a step at ~100 GB/s
STEPS = 6  # steps a gpu_step run takes (gpu_check's --steps default)
STEPS_START_S = 20  # a steps part's own start: imports, the GPU's properties, its corpus
SUMMARY_S = 10  # kept back from the deadline for the summary
PARTS_LOG = "parts.log"  # the output of the parts that are neither tests nor step runs
PRECHECKS_S = 5  # a compiler, Python.h, ninja, /dev/shm: what the node lacks, found first
PIP_S, OP_BUILD_S = 40, 65
GOLDEN_STEPS, GOLDEN_STEP_S = 30, 0.05  # tools/golden_losses.py's steps of the tiny model
# the models' shapes (recipes/model, benchmarks/gpu_step.py's SHAPES; tests/test_gpu_check.py holds them to the
# recipes): layers, vocabulary, d_ff, seconds a step
MODELS = {"1B-3L": (3, 128256, 8192, 0.7), "1B": (16, 128256, 8192, 3.3), "350M": (32, 32000, 2560, 2.0)}


def table_params(model: str, variant: str) -> int:
    """The host table parameters a gpu_step variant builds (none for dense)."""
    if variant == "dense":
        return 0
    layers, vocab, d_ff, _ = MODELS[model]
    return len(stem_layer_indices(layers, "full" if variant.startswith("stem_full") else "1/3")) * vocab * d_ff


def run_terms(model: str, variant: str) -> list[tuple[str, float]]:
    """A step run's planned seconds, term by term."""
    params, step_s = table_params(model, variant) / 1e9, MODELS[model][3]
    terms = [("start", START_S), (f"{STEPS} steps x {step_s} s", STEPS * step_s)]  # (what, seconds)
    if params:
        terms.append((f"{params:.2f}G table params x {TABLE_S_PER_G:.1f} s/G", params * TABLE_S_PER_G))
    if "resident" in variant:
        terms.append(("working set compile", COMPILE_S))
    if variant.endswith("_dense") and params:
        terms.append((f"dense row Adam {STEPS} x {params:.2f}G x {DENSE_ADAM_S_PER_G} s/G", STEPS * params
                      * DENSE_ADAM_S_PER_G))
    return terms


def run_seconds(model: str, variant: str) -> int:
    return round(sum(seconds for _, seconds in run_terms(model, variant)))


def golden_terms() -> list[tuple[str, float]]:
    """tools/golden_losses.py --check: two CPU jobs write the starting weights side by side, then the three configs
    train side by side on the GPU."""
    return [("starting weights on the CPU: one start", START_S), ("3 configs on the GPU: one start", START_S),
            (f"{GOLDEN_STEPS} steps x {GOLDEN_STEP_S} s", GOLDEN_STEPS * GOLDEN_STEP_S),
            ("working set compile", COMPILE_S)]


@dataclass(frozen=True)
class Part:
    """One part of the check: ``kind`` prechecks | setup | steps | golden | tests | layer | doctor, its log in OUT,
    its planned seconds (a steps part: its start and each variant's run) and the seconds it is stopped after."""

    name: str
    kind: str
    log: str = ""
    seconds: int = 0
    cap: int = 0
    model: str = ""
    variants: tuple[str, ...] = ()
    tests: tuple[str, ...] = ()
    source: str = ""  # where ``seconds`` comes from

    def planned(self, variants: Optional[tuple[str, ...]] = None) -> int:
        """The seconds the part is planned at (a steps part: with ``variants``, default all of its own)."""
        if self.kind != "steps":
            return self.seconds
        return STEPS_START_S + sum(run_seconds(self.model, v) for v in (self.variants if variants is None
                                                                        else variants))

    def arithmetic(self) -> list[str]:
        """The estimate's sources, for the dry run."""
        if self.kind != "steps":
            return [self.source] if self.source else []
        return [f"{STEPS_START_S} s part start"] + [
            f"{v}: {' + '.join(f'{what} ({s:.0f})' for what, s in run_terms(self.model, v))} = "
            f"{run_seconds(self.model, v)}" for v in self.variants]

    def what(self) -> str:
        """The part in a few words, for the dry run."""
        if self.kind == "steps":
            return f"benchmarks/gpu_step.py {self.model}: {', '.join(self.variants)}"
        return {"prechecks": "a C compiler, Python.h, ninja, /dev/shm for the tables (tools/gpu_prechecks.py)",
                "setup": "make setup (offline: a wheelhouse on the node's torch) and the row-Adam op build",
                "golden": "tools/golden_losses.py --check: the tiny model's recorded CPU losses, in bf16",
                "tests": f"{len(self.tests)} tests of tests/test_gpu.py", "layer": "benchmarks/stem_layer.py",
                "doctor": "stem-doctor --steps 5"}[self.kind]


DOCTOR_TEST = "test_doctor_trains_on_the_gpu_as_on_the_cpu"  # run as the doctor part, not as a test
# tests/test_gpu.py: what no CPU test can fail, in seconds each, most telling first
GPU_ONLY = ("test_a_working_set_on_the_gpu_trains_its_rows_as_the_cpu_and_pins_nothing_after_it_is_built",
            "test_the_stem_layer_slot_adam_and_a_landing_copy_never_synchronise_the_device",
            "test_sdpa_takes_the_flash_kernel_at_1b_shapes",
            "test_pinned_staging_delivers_every_fetch_intact",
            "test_pinned_blocks_are_what_the_memory_plan_counts",
            "test_row_gradients_land_on_the_host_intact",
            "test_two_threads_fetching_through_one_store_get_the_host_rows")
# the rest: torchrun trainings of the demo (a cold compile each) and the sanitizer's runs, minutes
TRAINING = ("test_gpu_training_with_host_tables_learns_and_a_working_set_trains_alike",
            "test_an_audited_host_table_step_with_validation_beside_it",
            "test_the_working_set_s_streams_pass_the_cuda_sanitizer",
            "test_a_host_table_step_with_its_prefetch_and_cpu_adam_passes_the_cuda_sanitizer",
            "test_a_tiny_llama_imports_and_converts_to_stem_on_the_gpu")

PARTS = (  # fits BUDGET_S with SUMMARY_S: the headline ratios, the golden losses, the layer's ratio; the GPU tests next
    Part("prechecks", "prechecks", seconds=PRECHECKS_S, cap=30, source="nvidia-smi -L, which, statvfs: seconds"),
    Part("setup", "setup", PARTS_LOG, PIP_S + OP_BUILD_S, 300,
         source=f"pip from the wheelhouse {PIP_S} s + the row-Adam op build {OP_BUILD_S} s (first H100 run)"),
    Part("1B-3L headline", "steps", "gpu_step.log", model="1B-3L",
         variants=("dense", "stem_1_3_resident_lazy", "stem_1_3_host_lazy")),
    Part("golden losses", "golden", PARTS_LOG, round(sum(s for _, s in golden_terms())), 240,
         source=" + ".join(f"{what} ({s:.0f})" for what, s in golden_terms())),
    Part("layer", "layer", PARTS_LOG, 45, 120, source="benchmarks/stem_layer.py at 350M and 1B: ~45 s"),
)
EXTRA = (  # --all (a second command), after PARTS
    Part("gpu tests", "tests", "gpu_tests.log", 130, 200, tests=GPU_ONLY,
         source="the seven GPU-only tests: 110-150 s"),
    Part("1B-3L others", "steps", "gpu_step.log", model="1B-3L",
         variants=("stem_full_resident_lazy", "stem_1_3_device", "stem_full_host", "stem_1_3_resident_dense",
                   "stem_1_3_host_dense")),
    Part("gpu tests, training", "tests", "gpu_tests.log", 360, 480, tests=TRAINING,
         source="four torchrun trainings of the demo (~300 s) and a Hugging Face import with from_dense (~60 s)"),
    Part("350M headline", "steps", "gpu_step.log", model="350M",
         variants=("dense", "stem_1_3_resident_lazy", "stem_1_3_host_lazy", "stem_full_resident_lazy")),
    Part("1B headline", "steps", "gpu_step.log", model="1B",
         variants=("dense", "stem_1_3_resident_lazy", "stem_1_3_resident_fit", "stem_1_3_host_lazy")),
    Part("350M others", "steps", "gpu_step.log", model="350M",
         variants=("stem_1_3_resident_fit", "stem_full_host", "stem_1_3_device", "stem_1_3_resident_dense",
                   "stem_1_3_host_dense")),
    Part("1B others", "steps", "gpu_step.log", model="1B",
         variants=("stem_1_3_device", "stem_1_3_resident_dense", "stem_1_3_host_dense")),
    Part("stem-doctor", "doctor", PARTS_LOG, 90, 120, source="two 5-step trainings of the tiny model: ~90 s"),
)


def plan_part(part: Part, state: dict, left: Optional[float]) -> tuple[Optional[tuple[str, ...]], str]:
    """What of ``part`` to run with ``left`` seconds (None: no deadline), after what ``state`` holds from earlier
    commands: (None and why, or the variants to run: those of a steps part not measured yet that fit, in order, ()
    for a part without variants)."""
    if part.kind != "steps":
        if not state["parts"].get(part.name, {}).get("status", "not run").startswith("not run"):
            return None, "ran earlier"
        if left is not None and left < part.seconds:
            return None, f"not run: {left:.0f} s left, it needs about {part.seconds} s"
        return (), ""
    measured = {r["variant"] for r in state["records"] if r["model"] == part.model and r["status"] != "not run"}
    missing = tuple(v for v in part.variants if v not in measured)
    if not missing:
        return None, "ran earlier"
    fit = len(missing) if left is None else max(
        (n for n in range(1, len(missing) + 1) if part.planned(missing[:n]) <= left), default=0)
    if fit == 0:
        return None, (f"not run: {left:.0f} s left, its first run needs about "
                      f"{part.planned(missing[:1]) - STEPS_START_S} s")
    return missing[:fit], ""


def plan(parts: tuple[Part, ...]) -> str:
    """The dry run: every part with its planned seconds and their source, then the total."""
    lines = ["gpu-check plan (seconds planned on one H100/H200 with 16 cores; tools/gpu_plan.py has the figures):"]
    for part in parts:
        lines.append(f"  {part.name:<20} {part.planned():>5}  {part.what()}")
        lines += [f"  {'':<20} {'':>5}    {line}" for line in part.arithmetic()]
    lines.append(f"  {'summary':<20} {SUMMARY_S:>5}  kept back from the deadline")
    total = sum(p.planned() for p in parts) + SUMMARY_S
    lines.append(f"  {'total':<20} {total:>5}  ({total / 60:.1f} min"
                 + (")" if total <= BUDGET_S else f"; more than one command's {BUDGET_S} s)"))
    return "\n".join(lines) + "\n"
