"""Knowledge edits on models trained only on synthetic facts: how often does swapping two subjects'
STEM rows move each prompt to the other subject's answer (paper §5.2, Fig. 5)?

Each configuration trains the tiny model on "The capital of X is Y." facts (``stem_megatron.data.facts``:
100 subjects, 16 answers, every fact 200 times) for ``--steps`` steps in one process, exports it,
and then, for 50 pairs of recalled subjects with different answers, swaps their rows at every STEM
layer (undone after each pair). Reported per configuration: fact recall, edit top-1 (the prompt's
top-1 is now the other answer), flips (the other answer now outscores the prompt's own) and stays
(top-1 still its own answer). A subject's identity also lives in its input embedding and in the dense
layers, which a row swap leaves alone; the configurations vary how much of the model is STEM and
how large the rows start.

Run: ``.venv/bin/python benchmarks/knowledge_edit.py [--steps 100] [--jobs 2]``  (about 5 minutes).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's stem_megatron, installed or not
from stem_megatron.setup_check import DEMO_CORPUS, corpus_problem, require_environment  # noqa: E402

require_environment()  # before torch and megatron: another Python gets `make setup`, not a traceback

from stem_megatron.parallel import child_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = {  # name -> Hydra overrides
    "STEM-full": ["variant=stem_full"],
    "STEM-full, rows init std 0.9": ["variant=stem_full", "stem.table_init_std=0.9"],
    "STEM in all 6 layers": ["variant=stem_full", "stem.layers=[0,1,2,3,4,5]"],
    "STEM-1/2, rows init std 0.9": ["variant=stem_1_2", "stem.table_init_std=0.9"],
}


def build(out: Path) -> Path:
    """The facts corpus (``out/facts.{bin,idx,json}``), built once."""
    from stem_megatron.data.facts import build_facts

    prefix = out / "facts"
    if not prefix.with_suffix(".json").exists():
        build_facts(DEMO_CORPUS / "tokenizer.json", prefix, num_subjects=100, num_answers=16, repeats=200)
    return prefix


def train(out: Path, overrides: list[str], steps: int = 100) -> Path:
    """Train on ``build(out.parent)``'s facts with ``overrides``; returns the export (``out/export``)."""
    out = out.resolve()  # data.blend resolves relative prefixes against data.dir
    facts_prefix = build(out.parent)
    shutil.rmtree(out, ignore_errors=True)  # a fresh run and export every time
    cmd = [sys.executable, "-m", "stem_megatron.train", "parallel=single", "host_tables.placement=device",
           f"train.steps={steps}", "train.eval_iters=0", f"data.dir={DEMO_CORPUS}",
           f"data.blend=[[1,'{facts_prefix}']]", f"out_dir={out}", "checkpoint.resume=false",
           f"checkpoint.export={out / 'export'}", *overrides]
    env = child_env(OMP_NUM_THREADS="1")  # the thread count changes float sums, hence the rates
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"training failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return out / "export"


def score(export: Path, pairs: int = 50) -> dict:
    """Fact recall and edit rates of an export trained by ``train`` (in the main thread: megatron's CPU
    redirection is per thread)."""
    from stem_megatron.data.facts import Facts
    from stem_megatron.eval.facts import edit_success, fact_recall
    from stem_megatron.inference.model import InferenceModel

    model = InferenceModel(export, device="cpu")
    facts = Facts.load(export.parent.parent / "facts.json")
    recall = fact_recall(model, facts)
    return {"recall": recall["recall"], "majority": recall["majority"],
            **edit_success(model, facts, recall["recalled"], pairs=pairs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/knowledge_edit"))
    args = parser.parse_args()
    if problem := corpus_problem(DEMO_CORPUS):
        parser.error(problem)
    build(args.out)
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {name: pool.submit(train, args.out / f"run{i}", overrides, args.steps)
                   for i, (name, overrides) in enumerate(CONFIGS.items())}
        exports = {name: f.result() for name, f in futures.items()}
    results = {name: score(export) for name, export in exports.items()}
    print(f"| configuration ({args.steps} steps) | fact recall | edit top-1 | flips | stays | pairs |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        rates = " | ".join("–" if r[k] is None else f"{100 * r[k]:.0f}%" for k in ("edit_success", "edit_flips",
                                                                                   "edit_stays"))
        print(f"| {name} | {100 * r['recall']:.0f}% | {rates} | {r['pairs']} |")


if __name__ == "__main__":
    main()
