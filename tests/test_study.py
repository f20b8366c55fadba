"""Synthetic facts, the knowledge-edit experiment on a model trained on them, and the reproduction study
(benchmarks/study.py) end to end. These use the real corpus' tokenizer (``tools/setup.sh`` builds it):
the facts need words that it keeps as single tokens."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "data_cache" / "python-doc"
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.fixture(scope="module")
def tokenizer_path():
    path = CORPUS / "tokenizer.json"
    assert path.is_file(), f"{path} is missing: run `bash tools/setup.sh` (make test does) to build the corpus"
    return path


def test_facts_corpus_has_every_fact_repeats_times(tokenizer_path, tmp_path):
    from stem_megatron.data.facts import TEMPLATE, Facts, build_facts
    from stem_megatron.data.tokenizer import HFTokenizer

    stats = build_facts(tokenizer_path, tmp_path / "facts", num_subjects=40, num_answers=6, repeats=5,
                        facts_per_doc=7)
    facts, tok = Facts.load(tmp_path / "facts.json"), HFTokenizer(tokenizer_path)
    assert len(facts.answer) == 40 and len(set(facts.answer.values())) <= 6
    assert not set(facts.answer) & set(facts.answer_id)  # subjects and answers are different words
    docs = IndexedDataset(str(tmp_path / "facts"))
    assert len(docs) == stats["docs"] == -(-40 * 5 // 7)
    lines = []
    for i in range(len(docs)):
        ids = docs[i].tolist()
        assert ids[-1] == tok.eod
        lines += tok.detokenize(ids[:-1]).split("\n")
    expected = sorted(TEMPLATE.format(x=x, y=y) for x, y in facts.answer.items())
    assert sorted(set(lines)) == expected and all(lines.count(line) == 5 for line in expected)
    for x, y in list(facts.answer.items())[:10]:  # one token each, the answer right after the prompt
        prompt = tok.tokenize(facts.prompt(x))
        assert prompt[-2] == facts.subject_id[x] and tok.tokenize(f" {x}") == [facts.subject_id[x]]
        assert tok.tokenize(TEMPLATE.format(x=x, y=y))[:len(prompt) + 1] == prompt + [facts.answer_id[y]]


def test_facts_reject_bad_requests(tokenizer_path, tmp_path):
    from stem_megatron.data.facts import Facts, build_facts

    with pytest.raises(ValueError, match="single-token words"):
        build_facts(tokenizer_path, tmp_path / "f", num_subjects=100_000, num_answers=4)
    (tmp_path / "old.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="rebuild it"):
        Facts.load(tmp_path / "old.json")


# -------------------------------------------------------------------------------- knowledge edit
@pytest.mark.slow
def test_swapping_subject_rows_moves_the_fact(tokenizer_path, tmp_path):
    """STEM-full trained on 100 facts for 150 steps (benchmarks/knowledge_edit.py, rows init std 0.9): most
    swaps of two subjects' rows make each prompt prefer the other subject's answer, and undoing them restores
    the model. (Since the device table draws the host store's rows, 100 steps recall 0.76 of the facts, 150
    steps all of them.)"""
    from knowledge_edit import CONFIGS, score, train

    from stem_megatron.data.facts import Facts
    from stem_megatron.edit.edits import StemEditor
    from stem_megatron.eval.facts import answer_logits, edit_success, fact_recall
    from stem_megatron.inference.model import InferenceModel

    export = train(tmp_path / "run", CONFIGS["STEM-full, rows init std 0.9"], steps=150)
    result = score(export)
    print(f"recall {result['recall']:.2f}, edit on {result['pairs']} pairs: top-1 {result['edit_success']:.2f}, "
          f"flips {result['edit_flips']:.2f}, stays {result['edit_stays']:.2f}")
    assert result["recall"] >= 0.8 > result["majority"]
    assert result["pairs"] == 50
    assert result["edit_flips"] > 0.5  # most prompts now prefer the other subject's answer
    assert result["edit_success"] > 0.3 > result["edit_stays"]  # the other answer by chance: ~1/16

    model, facts = InferenceModel(export, device="cpu"), Facts.load(tmp_path / "facts.json")
    before = {k: t.clone() for k, t in StemEditor.from_model(model).tables.items()}
    logits_before = answer_logits(model, facts, list(facts.answer))
    edit_success(model, facts, fact_recall(model, facts)["recalled"], pairs=10)
    after = StemEditor.from_model(model).tables  # every swap was undone
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert torch.equal(answer_logits(model, facts, list(facts.answer)), logits_before)


# ----------------------------------------------------------------------------------- the study
def test_report_calls_a_difference_only_when_seeds_separate():
    from study_report import compare, summary

    assert compare(summary([1.0, 1.1]), summary([1.2, 1.3])) == "lower"
    assert compare(summary([1.4, 1.5]), summary([1.2, 1.3])) == "higher"
    assert compare(summary([1.0, 1.25]), summary([1.2, 1.3])) == "within"
    assert compare(summary([1.0]), summary([2.0])) == "single"
    assert summary([None, None]) is None and summary([2.0, None, 4.0])["mean"] == 3.0


def test_each_arm_is_a_hydra_sweep_cut_into_products_of_jobs_size():
    from study_arms import ABLATION, VARIANTS, arms, chunks, sweep_command

    main, ablation, stress = arms(list(VARIANTS), [1, 2, 3], [1, 2], [1, 2, 3], steps=600, stress_steps=300,
                                  stress_lr=3e-2)
    assert (len(main.points()), len(ablation.points()), len(stress.points())) == (21, 16, 9)
    full = sweep_command(main, main.points(), "/out/main", ["parallel=single"])
    assert full[1:5] == ["-m", "stem_megatron.train", "-m", "hydra/launcher=submitit_local"]
    assert full[-2:] == [f"variant={','.join(VARIANTS)}", "train.seed=1,2,3"]
    assert "hydra.sweep.subdir=${hydra:runtime.choices.variant}/seed${train.seed}" in full
    assert {"logging.wandb=true", "logging.group=study-main", "checkpoint.export=${out_dir}/export",
            "train.steps=600", "train.eval_interval=60"} <= set(full)
    ab = sweep_command(ablation, ablation.points(), "/out/ablation", [])
    assert "variant=stem_1_3" in ab and all(f"{k}={','.join(v)}" in ab for k, v in ABLATION.items())
    assert ablation.run_name(ablation.points()[0]) == "scaled-global-lazy/seed1"
    assert "hydra.sweep.subdir=${stem.table_init}-${host_tables.clip}-${host_tables.optimizer}/seed${train.seed}" in ab
    st = sweep_command(stress, stress.points(), "/out/stress", [])
    assert {"train.lr=0.03", "variant=dense,stem_1_3,hash_moe", "train.steps=300"} <= set(st)
    assert not any(c.startswith("checkpoint.export") for c in st)  # scored from metrics.jsonl alone
    for arm in (main, ablation, stress):
        cut = chunks(arm.points(), 2)
        assert sorted(arm.run_name(p) for c in cut for p in c) == sorted(arm.run_name(p) for p in arm.points())
        assert all(len(c) <= 2 for c in cut) and len(cut) == -(-len(arm.points()) // 2)
        for c in cut:
            sweep_command(arm, c, "/out", [])  # asserts the points form a product
    assert [[main.run_name(p) for p in c] for c in chunks(main.points(), 2)[:2]] == \
        [["dense/seed1", "dense/seed2"], ["dense/seed3", "stem_1_3/seed3"]]  # seeds of a setting together
    lean, = arms([], [], [], [], steps=600, stress_steps=300, stress_lr=3e-2, which=["lean"], lean_seeds=[1, 2])
    le = sweep_command(lean, lean.points(), "/out/lean", [])
    assert le[-3:] == ["variant=stem_1_3,stem_full", "table_state=fp32,lean", "train.seed=1,2"]
    assert "hydra.sweep.subdir=${hydra:runtime.choices.variant}-${hydra:runtime.choices.table_state}" \
        "/seed${train.seed}" in le and "train.steps=600" in le  # the main arm's steps, tokens and lr
    assert lean.run_name(lean.points()[-1]) == "stem_full-lean/seed2"
    more, = arms([], [], [], [], steps=600, stress_steps=300, stress_lr=3e-2, which=["lean"], lean_seeds=[1, 2],
                 lean_variants=["stem_1_3"], lean_states=["fp32", "moments", "bf16_master", "lean"])
    assert sweep_command(more, more.points(), "/out/lean", [])[-3:] == \
        ["variant=stem_1_3", "table_state=fp32,moments,bf16_master,lean", "train.seed=1,2"]
    for p in lean.points()[:2]:  # a run's identity (its one-point command) is the same when the lists grow
        assert sweep_command(more, [p], "/out/lean", []) == sweep_command(lean, [p], "/out/lean", [])


def _fake_run(run_dir, variant, seed, final, spikes=(), status="finished", ratio="1/3", steps=40, host_tables=None,
              recall=None):
    import dataclasses

    from stem_megatron.config import RunConfig, STEMConfig, TrainConfig

    run_dir.mkdir(parents=True)
    stem = "stem" if variant.startswith("stem") else variant
    cfg = RunConfig(stem=STEMConfig(variant=stem, ratio="0" if stem == "dense" else ratio),
                    train=TrainConfig(steps=steps, seed=seed, lr=3e-3))  # recipes/train.yaml's peak
    config = dataclasses.asdict(cfg)
    config["host_tables"].update(host_tables or {})
    (run_dir / "config.json").write_text(json.dumps(config))
    records = [{"step": s, "loss": 8.0 - s * 0.05 + (3.0 if s in spikes else 0.0), "step_time_s": 0.5,
                "tokens": s * 1024, "loss_spike": s in spikes} | ({"valid_loss": final} if s == steps else {})
               for s in range(1, steps + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    ev = {"valid_nll": final, "valid_accuracy": 0.3 - final / 100, "fact_recall": 0.5 + seed / 10 if recall is None else recall, "facts": 20,
          "fact_majority": 0.1, "edit_success": None, "edit_flips": None, "edit_stays": None,
          "params_total": 1e6, "params_active": 1e6, "train_tokens": 40960, "flops_per_token": 1e6,
          "train_flops": 4e10}
    (run_dir / "eval.json").write_text(json.dumps(ev))
    (run_dir / "study.json").write_text(json.dumps({"status": status, "error": "FloatingPointError: non-finite"
                                                    if status == "diverged" else None, "machine_s": 30.0}))


LEAN_KEYS = {"fp32": None, "moments": {"state_dtype": "bf16", "second_moment": "row"},
             "lean": {"state_dtype": "bf16", "second_moment": "row", "master_dtype": "bf16", "read_dtype": "bf16"}}


def _fake_lean_runs(out, lean, gap):
    """The lean arm's runs but STEM-full's moments (a cell without runs): final validation loss 4.5 (STEM-1/3) or
    4.4 (STEM-full) + seed / 100, fact recall 0.9 + seed / 100, the lean runs ``gap[variant](seed)`` from their fp32
    partners in loss, the moments runs 0.01 higher in loss and 0.2 lower in recall."""
    for p in lean.points():
        variant, seed, state = p["variant"], int(p["train.seed"]), p["table_state"]
        if (variant, state) == ("stem_full", "moments"):
            continue
        final = {"stem_1_3": 4.5, "stem_full": 4.4}[variant] + seed / 100 + (
            {"lean": gap[variant](seed), "moments": 0.01}.get(state, 0.0))
        run_dir = out / "lean" / lean.run_name(p)
        if run_dir.exists():
            shutil.rmtree(run_dir)
        _fake_run(run_dir, variant, seed, final, ratio="full" if variant == "stem_full" else "1/3",
                  host_tables=LEAN_KEYS[state], recall=0.9 + seed / 100 - (0.2 if state == "moments" else 0.0))


def test_report_tables_from_fabricated_runs(tmp_path):
    from conversion_study import write_section
    from study_arms import ABLATION, arms
    from study_lean import write_lean
    from study_report import write_report

    main, ablation, stress, lean = arms(["dense", "stem_1_3", "hash_moe"], [1, 2], [1, 2], [1, 2], 40, 40, 1.5e-2,
                                        ["main", "ablation", "stress", "lean"], [1, 2],
                                        lean_states=["fp32", "moments", "lean"])
    out = tmp_path / "study"
    for p in main.points():
        _fake_run(out / "main" / main.run_name(p), p["variant"], int(p["train.seed"]),
                  {"dense": 4.8, "stem_1_3": 4.5, "hash_moe": 4.7}[p["variant"]] + int(p["train.seed"]) / 100)
    for p in ablation.points():  # xavier worse in every pair, dense Adam better by less than the seed spread
        seed = int(p["train.seed"])
        bad = 0.3 if p["stem.table_init"] == "xavier" else 0.0
        good = -0.005 if p["host_tables.optimizer"] == "dense" else 0.0
        _fake_run(out / "ablation" / ablation.run_name(p), "stem_1_3", seed, 4.5 + bad + good + seed / 100)
    for p in stress.points():
        spikes = {"hash_moe": (10, 25, 30), "dense": (20,), "stem_1_3": ()}[p["variant"]]
        _fake_run(out / "stress" / stress.run_name(p), p["variant"], int(p["train.seed"]), 5.0, spikes=spikes,
                  status="diverged" if p["variant"] == "dense" and p["train.seed"] == "2" else "finished")
    study = {"arms": {a.name: {"swept": a.swept, "fixed": a.fixed, "steps": a.steps,
                               "runs": [a.run_name(p) for p in a.points()], "command": f"python -m ... {a.name}"}
                      for a in (main, ablation, stress)},
             "variants": ["dense", "stem_1_3", "hash_moe"], "seeds": [1, 2], "steps": 40, "jobs": 2, "threads": 1,
             "facts_share": 30, "subjects": 20, "answers": 4, "repeats": 30, "overrides": [], "stress_lr": 1.5e-2,
             "wall_s": 60.0, "command": "python benchmarks/study.py"}
    report = tmp_path / "docs" / "results.md"
    report.parent.mkdir()
    report.write_text("an earlier report\n")
    conversion = "<!-- conversion-study: begin -->\n## Dense to STEM conversion\n<!-- conversion-study: end -->"
    _fake_lean_runs(out, lean, {"stem_1_3": lambda seed: 0.004, "stem_full": lambda seed: 0.03 if seed == 2 else -0.02})
    lean_study = {**study, "arms": {"lean": {"swept": lean.swept, "steps": 40, "command": "python -m ... lean",
                                             "runs": [lean.run_name(p) for p in lean.points()
                                                      if (out / "lean" / lean.run_name(p)).is_dir()]}},
                  "command": "python benchmarks/study.py --arms lean"}
    section = write_lean(out, report, lean_study)  # the lean arm alone, before the main report: appended
    write_section(report, conversion)  # benchmarks/conversion_study.py's section, after it
    write_report(out, report, study)  # keeps both
    text = report.read_text()
    assert "an earlier report" not in text and text.endswith("\n" + section + "\n\n" + conversion + "\n")
    assert "| STEM-1/3 | fp32 AdamW | 4.5150 [4.5100, 4.5200] |" in section
    assert "| STEM-full | lean | 4.4200 [4.3900, 4.4500] |" in section
    assert "| STEM-1/3 | bf16 moments, row-wise 2nd | 4.5250 [4.5200, 4.5300] | 25.5% [25.5%, 25.5%] | " \
        "71.5% [71.0%, 72.0%] |" in section and "| STEM-full | bf16 moments" not in section  # no runs: no row
    assert ("- `table_state=moments` (recipes/table_state/moments.yaml: `host_tables.state_dtype=bf16`, "
            "`host_tables.second_moment=row`): 6.17 B of host memory per table parameter") in section  # d_ff 192
    assert "`host_tables.second_moment=row`, `host_tables.master_dtype=bf16`): 4.17 B of host" in section
    assert "- `table_state=fp32` (recipes/table_state/fp32.yaml: the recipes' default): 12.00 B of host" in section
    assert ("- STEM-1/3, lean − fp32, final validation loss: seed 1 +0.0040, seed 2 +0.0040 (mean +0.0040): "
            "**higher in every pair** by 0.0040 [0.0040, 0.0040] (by chance: 2/2^2 = 50.0%); within fp32's seed "
            "spread (0.0100).") in section
    assert ("- STEM-full, lean − fp32, final validation loss: seed 1 -0.0200, seed 2 +0.0300 (mean +0.0050): "
            "**no consistent difference** (lower in 1 and higher in 1 of 2 pairs); beyond fp32's seed spread "
            "(0.0100).") in section
    assert ("- STEM-1/3, bf16 moments, row-wise 2nd − fp32, fact recall (pp): seed 1 -20.0, seed 2 -20.0 (mean "
            "-20.0): **lower in every pair** by 20.0 pp [20.0, 20.0] (by chance: 2/2^2 = 50.0%); beyond fp32's seed "
            "spread (1.0 pp).") in section
    assert "- STEM-1/3, lean − fp32, fact recall (pp): seed 1 +0.0, seed 2 +0.0 (mean +0.0): **no consistent" in section
    assert "STEM-full, bf16 moments" not in section
    assert "The arm's sweep: `python -m ... lean`" in section
    _fake_lean_runs(out, lean, {"stem_1_3": lambda seed: -0.02, "stem_full": lambda seed: 0.0})  # the arm reruns
    again = write_lean(out, report, lean_study)
    assert "STEM-1/3, lean − fp32, final validation loss: seed 1 -0.0200, seed 2 -0.0200 (mean -0.0200): " \
        "**lower in every pair**" in again
    assert report.read_text() == text.replace(section, again)  # replaced in place, the rest as it was
    text = text.replace(section, again)
    write_section(report, conversion.replace("conversion\n", "conversion, again\n"))  # replaced in place
    assert report.read_text() == text.replace("conversion\n", "conversion, again\n")
    assert "## How to run" in text and "- ablation: `python -m ... ablation`" in text
    assert "in 14 min of sweeps (main 3, ablation 8, stress 3)" in text  # 6, 16 and 6 runs, 30 s each
    assert "STEM-1/3 beats dense" in text and "(final_valid_loss: below) — **agrees** with the paper" in text
    rows = [line for line in text.splitlines() if line.startswith("| scaled") or line.startswith("| xavier")]
    assert len(rows) == 8 and rows[0].startswith("| scaled / global / lazy (defaults) | 4.5150 [4.5100, 4.5200]")
    lines = {k: next(line for line in text.splitlines() if line.startswith(f"- `{k}=")) for k in ABLATION}
    assert ("8 pairs of runs (same seed and other settings): difference +0.3000 [+0.3000, +0.3000], lower in 0 and "
            "higher in 8 of 8 pairs: **worse** than the default in every pair (by chance: 2/2^8 = 0.8%)"
            in lines["stem.table_init"])
    assert "lower in 0 and higher in 0 of 8 pairs: **no consistent difference**" in lines["host_tables.clip"]
    assert "difference -0.0050 [-0.0050, -0.0050], lower in 8 and higher in 0 of 8 pairs: **better**" \
        in lines["host_tables.optimizer"]  # the pooled ranges overlap (seed spread 0.01), the pairs do not
    assert "| Hash-MoE-1/3 | 1 | 3 | [10, 25, 30] | 10.500 | 6.000 | no |" in text
    assert "| dense | 2 | 1 | [20] | 10.000 | 6.000 | yes: FloatingPointError: non-finite" in text
    assert "spikes per run dense [1, 1] (1 diverged), STEM-1/3 [0, 0], Hash-MoE-1/3 [3, 3] — **agrees**" in text
    assert "lr 0.015 (5x the recipe's peak)" in text
    for png in re.findall(r"\]\((results/[a-z_]+\.png)\)", text):
        assert (report.parent / png).stat().st_size > 10_000
    assert len(re.findall(r"\.png\)", text)) == 5


@pytest.mark.slow
def test_study_runs_end_to_end_and_writes_its_report(tmp_path):
    """Two tiny runs of the main arm through the real sweep (submitit_local, both side by side), scored,
    reported; the same command again finds both finished."""
    out, report = tmp_path / "study", tmp_path / "docs" / "results.md"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "study.py"), "--arms", "main", "--variants", "dense", "stem_1_3",
           "--seeds", "1", "--steps", "4", "--subjects", "20", "--answers", "4", "--repeats", "30",
           "--valid-windows", "4", "--eval-iters", "1", "--out", str(out), "--report", str(report),
           "--facts-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = report.read_text()
    for variant, label in (("dense", "dense"), ("stem_1_3", "STEM-1/3")):
        run = out / "main" / variant / "seed1"
        ev = json.loads((run / "eval.json").read_text())
        row = next(line for line in text.splitlines() if line.startswith(f"| {label} |"))
        assert f"{100 * ev['fact_recall']:.1f}%" in row
        assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
        assert len(list((run / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
        assert json.loads((run / "study.json").read_text())["status"] == "finished"
        assert not (run / "checkpoints").exists() and (run / "export").is_dir()
    assert "main: `python -m stem_megatron.train -m hydra/launcher=submitit_local" in text
    assert "**one seed**: no spread to judge by, no verdict" in text
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)  # finished runs are kept
    assert again.returncode == 0 and "[main] 2 runs done earlier" in again.stdout, again.stdout[-2000:]
    assert re.sub(r"\d+ min", "", report.read_text()) == re.sub(r"\d+ min", "", text)


@pytest.mark.slow
def test_conversion_study_runs_end_to_end_and_writes_its_section(tmp_path):
    """benchmarks/conversion_study.py at its smallest (one seed, 4 + 2 steps): every run, the dense model exported
    to Hugging Face and imported three ways, each scored, the section written into an existing report. The dense
    import before any update is the exported model: its validation loss is the base run's last one, exactly."""
    out, report = tmp_path / "conversion", tmp_path / "results.md"
    report.write_text("# the main study's report\n")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "conversion_study.py"), "--seeds", "1", "--steps", "4",
           "--more", "2", "--calibration-tokens", "1024", "--eval-iters", "1", "--valid-windows", "4",
           "--subjects", "20", "--answers", "4", "--repeats", "30", "--facts-dir", str(tmp_path),
           "--out", str(out), "--report", str(report)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())["1"]
    assert set(results) == {"base", "dense", "stem-scaled", "stem-from_dense", "scratch"}
    assert results["dense"]["after_conversion"] == results["base"]["valid"]
    for arm in ("stem-scaled", "stem-from_dense"):  # STEM-1/3 of 6 layers: 2 layers changed
        assert results[arm]["after_conversion"] != results["base"]["valid"]
    assert results["stem-from_dense"]["flops"] == results["base"]["flops"] + json.loads(
        (out / "seed1" / "stem-from_dense" / "eval.json").read_text())["train_flops"]
    text = report.read_text()
    assert text.startswith("# the main study's report\n") and "## Dense to STEM conversion\n" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "steps" in line]
    assert len(rows) == 5 and rows[-1].startswith("| STEM-1/3 from scratch, 6 steps | – |")
    assert "(`stem-export-hf`)" in text and "--more" not in text
