"""The study's arms as Hydra sweeps of ``python -m stem_megatron.train -m`` (benchmarks/study.py runs them).

An arm is a set of fixed overrides and swept keys; every point of its product is one run, in the directory
``<out>/<arm>/<name>/seed<s>``, the name made of the point's non-seed values. Hydra puts each job there
itself (``hydra.sweep.subdir`` is the same name as an interpolation), so the sweep command a user types and
the one the study runs are the same command. A sweep runs on Hydra's ``submitit_local`` launcher, which
starts every job of a sweep at once as its own process: a sweep of ``--jobs`` points is how the study keeps
that many runs side by side, so the points are cut into sweeps of that size (``chunks``).
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field

# recipes/variant name -> label used in the paper's Table 3
VARIANTS = {"dense": "dense", "stem_1_3": "STEM-1/3", "stem_1_2": "STEM-1/2", "stem_full": "STEM-full",
            "stem_dagger": "STEM†", "stem_gate": "STEM-gate", "hash_moe": "Hash-MoE-1/3"}
ABLATION = {"stem.table_init": ["scaled", "xavier"], "host_tables.clip": ["global", "separate"],
            "host_tables.optimizer": ["lazy", "dense"]}  # first value of each: the recipes' default
STRESS_VARIANTS = ["dense", "stem_1_3", "hash_moe"]
LEAN_VARIANTS = ["stem_1_3", "stem_full"]
# recipes/table_state name -> label; the first: the recipes' default, the paper's fp32 AdamW; the leanest last
TABLE_STATES = {"fp32": "fp32 AdamW", "bf16_moments": "bf16 moments", "moments": "bf16 moments, row-wise 2nd",
                "bf16_master": "bf16 master", "lean": "lean"}
LEAN_STATES = ["fp32", "lean"]  # the lean arm's states unless named (study.py --lean-states)
GROUPS = ("variant", "table_state")  # swept config groups: a job's directory names their choice
SEED = "train.seed"


@dataclass
class Arm:
    """One sweep: ``fixed`` overrides for every run, ``swept`` keys with their values (``train.seed`` last)."""

    name: str
    fixed: list[str]
    swept: dict[str, list[str]]
    scored: bool = True  # exported and scored by study_eval.py (the stress arm reads metrics.jsonl only)
    steps: int = 0
    extra: list[str] = field(default_factory=list)

    def points(self) -> list[dict[str, str]]:
        keys = list(self.swept)
        return [dict(zip(keys, values)) for values in itertools.product(*self.swept.values())]

    def run_name(self, point: dict[str, str]) -> str:
        """``<values of the non-seed keys joined by '-'>/seed<s>``, e.g. ``stem_1_3/seed1``."""
        return "-".join(v for k, v in point.items() if k != SEED) + f"/seed{point[SEED]}"

    def subdir(self) -> str:
        """``run_name`` as Hydra resolves it in the job (a config group's choice, not a key: ``GROUPS``)."""
        parts = ["${hydra:runtime.choices." + k + "}" if k in GROUPS else "${" + k + "}"
                 for k in self.swept if k != SEED]
        return "-".join(parts) + "/seed${" + SEED + "}"


def arms(variants, seeds, ablation_seeds, stress_seeds, steps: int, stress_steps: int, stress_lr: float,
         which=("main", "ablation", "stress"), lean_seeds=(1, 2, 3), lean_variants=LEAN_VARIANTS,
         lean_states=LEAN_STATES) -> list[Arm]:
    seeds, ablation_seeds, stress_seeds, lean_seeds = ([str(s) for s in ss] for ss in
                                                       (seeds, ablation_seeds, stress_seeds, lean_seeds))
    made = {
        "main": Arm("main", [], {"variant": list(variants), SEED: seeds}, steps=steps),
        "ablation": Arm("ablation", ["variant=stem_1_3"], {**ABLATION, SEED: ablation_seeds}, steps=steps),
        "stress": Arm("stress", [f"train.lr={stress_lr:g}"], {"variant": STRESS_VARIANTS, SEED: stress_seeds},
                      scored=False, steps=stress_steps),
        "lean": Arm("lean", [], {"variant": list(lean_variants), "table_state": list(lean_states), SEED: lean_seeds},
                    steps=steps),
    }
    return [made[name] for name in which]


def sweep_command(arm: Arm, points: list[dict[str, str]], arm_dir, common: list[str]) -> list[str]:
    """The ``-m`` command of ``points`` (a product: they differ in one key at most, see ``chunks``)."""
    keys = list(arm.swept)
    values = {k: list(dict.fromkeys(p[k] for p in points)) for k in keys}
    assert len(points) == len(list(itertools.product(*values.values()))), "points must form a product"
    return [
        sys.executable, "-m", "stem_megatron.train", "-m",
        "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=1440",
        f"hydra.sweep.dir={arm_dir}", f"hydra.sweep.subdir={arm.subdir()}",
        f"hydra.launcher.submitit_folder={arm_dir}/.submitit/%j",
        f"train.steps={arm.steps}", f"train.eval_interval={max(1, arm.steps // 10)}",
        *common, *(["checkpoint.export=${out_dir}/export"] if arm.scored else []),
        "logging.wandb=true", f"logging.group=study-{arm.name}", f"logging.tags=[study,{arm.name}]",
        *arm.fixed, *(f"{k}={','.join(values[k])}" for k in keys),
    ]


def chunks(points: list[dict[str, str]], size: int) -> list[list[dict[str, str]]]:
    """``points`` cut into sweeps of at most ``size`` runs, each a product (equal in every key but one);
    the seeds of one setting go together when they can, so the runs side by side take about as long."""
    keys = list(points[0]) if points else []
    left, out = list(points), []
    while left:
        first = left.pop(0)
        best: list = []
        for key in reversed(keys):  # the seed first: the first key that fills the sweep, else the most
            same = [q for q in left if all(q[k] == first[k] for k in keys if k != key)]
            if len(same) > len(best):
                best = same
            if len(best) >= size - 1:
                break
        for q in best[:size - 1]:
            left.remove(q)
        out.append([first, *best[:size - 1]])
    return out
