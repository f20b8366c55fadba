"""Synthetic facts, the knowledge-edit experiment on a model trained on them, and the reproduction study
(benchmarks/study.py) end to end. These use the real corpus' tokenizer (``tools/setup.sh`` builds it):
the facts need words that it keeps as single tokens."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
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


# ------------------------------------------------------------------------ knowledge edit (issue 7)
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


@pytest.mark.slow
def test_study_runs_end_to_end_and_writes_its_report(tmp_path):
    out, report = tmp_path / "study", tmp_path / "docs" / "results.md"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "study.py"), "--variants", "dense", "stem_1_3",
           "--seeds", "1", "2", "--steps", "4", "--subjects", "20", "--answers", "4", "--repeats", "30",
           "--valid-windows", "4", "--eval-iters", "1", "--out", str(out), "--report", str(report),
           "--facts-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = report.read_text()
    evals = {v: [json.loads((out / v / f"seed{s}" / "eval.json").read_text()) for s in (1, 2)]
             for v in ("dense", "stem_1_3")}
    for variant, label in (("dense", "dense"), ("stem_1_3", "STEM-1/3")):
        row = next(line for line in text.splitlines() if line.startswith(f"| {label} |"))
        recall = [e["fact_recall"] for e in evals[variant]]
        assert f"{100 * np.mean(recall):.1f}% [{100 * min(recall):.1f}%, {100 * max(recall):.1f}%]" in row
        metrics = (out / variant / "seed1" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in metrics] == [1, 2, 3, 4]
    assert evals["dense"][0]["edit_success"] is None and evals["stem_1_3"][0]["train_flops"] < \
        evals["dense"][0]["train_flops"]
    assert "## Against the paper" in text and "STEM-1/3 beats dense" in text
    for png in re.findall(r"\]\((results/[a-z_]+\.png)\)", text):
        assert (report.parent / png).stat().st_size > 10_000
    assert len(re.findall(r"\.png\)", text)) == 3
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)  # finished runs are kept
    assert again.returncode == 0 and again.stdout.count("done earlier") == 4, again.stdout[-2000:]
    assert re.sub(r"\(\d+ min", "", report.read_text()) == re.sub(r"\(\d+ min", "", text)
