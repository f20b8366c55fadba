"""``stem-export-hf``: a stem-megatron export as a Hugging Face directory that ``transformers`` loads with its own code
(export/hf/). Against the model ``stem-generate`` runs (``InferenceModel``, megatron-core's GPTModel): the same logits
(bound: 1e-5 absolute, fp32 rounding; on this CPU they come out bitwise equal), the same greedy tokens from
``generate()`` alone and in a left-padded batch, lm-eval's ``hf`` backend scoring a local task as our adapter does;
for every variant on a tiny export, and for the export of a TP=2 x PP=2 run."""

import json
import subprocess
import sys
from pathlib import Path

import distributed
import pytest
import torch
from conftest import VOCAB
from tiny_export import perturbed_weights, tiny_config

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "tests" / "data" / "mc_task.yaml"
PROMPTS = ["the heap queue", "def f(x): return"]
VARIANTS = ("stem", "stem_dagger", "stem_gate", "dense")
BOUND = 1e-5


def _every_variant(corpus, tmp: Path) -> dict:
    """Per variant: a tiny export (STEM in layer 2 of 3; dense: none), its HF directory and both models' outputs;
    then the stem variant's HF model loaded with its tables kept on the host and moved."""
    from stem_megatron.export.format import write_export
    from stem_megatron.export.hf.writer import export_hf

    got = {}
    for variant in VARIANTS:
        cfg = tiny_config(corpus, 3, 32, variant=variant, ratio="1/3")
        write_export(tmp / variant / "export", cfg, perturbed_weights(cfg), corpus / "tokenizer.json")
        export_hf(tmp / variant / "export", tmp / variant / "hf")
        got[variant] = _against_stem_generate(tmp / variant / "export", tmp / variant / "hf")
    got["tables"] = _tables_at_home(tmp / "stem" / "hf")
    return got


def _against_stem_generate(export: Path, hf_dir: Path) -> dict:
    """Logits of a right-padded batch, greedy tokens per prompt and in a left-padded batch, from both models."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stem_megatron.inference.generate import generate_batch
    from stem_megatron.inference.model import InferenceModel

    ref = InferenceModel(export, device="cpu")
    model = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=True)
    ids = [ref.encode(p) for p in PROMPTS]
    batch = torch.zeros(len(ids), max(map(len, ids)), dtype=torch.long)
    for row, p in enumerate(ids):
        batch[row, :len(p)] = torch.tensor(p)
    with torch.no_grad():
        diff = max((model(torch.tensor([p])).logits[0] - ref.logits(torch.tensor([p]))[0]).abs().max().item()
                   for p in ids)
        diff = max(diff, (model(batch).logits - ref.logits(batch)).abs().max().item())
    ours = generate_batch(ref, ids, 10).tokens
    theirs = [model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[0, len(p):].tolist() for p in ids]
    padded = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    together = model.generate(**padded, max_new_tokens=10, do_sample=False)[:, padded["input_ids"].shape[1]:]
    return {"diff": diff, "ours": ours, "theirs": theirs, "batched": together.tolist(),
            "same_ids": [tokenizer(p)["input_ids"] for p in PROMPTS] == ids}


def _cut_at_eod(tokens: list[int], eod: int = 0) -> list[int]:
    return tokens[:tokens.index(eod)] if eod in tokens else tokens


@pytest.mark.slow
def test_transformers_runs_every_variant_as_stem_generate_does(corpus, tmp_path):
    """stem, stem_dagger, stem_gate and dense: logits, greedy tokens alone and batched, each table in a shard of its
    own. With ``stem_tables_on_host=True`` (a from_pretrained keyword) ``.to(device)`` moves everything but the
    tables (never copying them there) and a dtype change reaches them too; on a GPU machine the same tokens would
    come with the tables on the host (not measured: no GPU here)."""
    (got,) = distributed.run(_every_variant, 1, corpus, tmp_path)
    for variant in VARIANTS:
        result = got[variant]
        assert result["diff"] <= BOUND, variant
        assert result["same_ids"], variant
        assert [_cut_at_eod(t) for t in result["theirs"]] == result["ours"], variant
        assert [_cut_at_eod(t) for t in result["batched"]] == result["ours"], variant
        config = json.loads((tmp_path / variant / "hf" / "config.json").read_text())
        assert config["stem_layers"] == ([] if variant == "dense" else [2])
        index = json.loads((tmp_path / variant / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
        tables = {name: file for name, file in index.items() if ".U_l." in name}
        assert len(tables) == (0 if variant == "dense" else 1)
        assert all(list(index.values()).count(file) == 1 for file in tables.values())  # a shard of its own
    assert got["tables"] == {"cast": "torch.float64", "table": "cpu", "rest": "meta"}


def _score_both(export: Path, hf_dir: Path) -> dict:
    """lm-eval's ``hf`` backend on the HF directory and our adapter on the export: the local task's
    per-choice log-likelihoods and accuracy."""
    from lm_eval.models.huggingface import HFLM

    from stem_megatron.eval.lm_adapter import STEMLM
    from stem_megatron.eval.tasks import run_tasks
    from stem_megatron.inference.model import InferenceModel

    scores = {}
    for name, lm in (("hf", HFLM(pretrained=str(hf_dir), trust_remote_code=True, batch_size=4, device="cpu")),
                     ("ours", STEMLM(model=InferenceModel(export, device="cpu"), batch_size=4))):
        out = run_tasks(lm, task_files=[str(TASK)], log_samples=True)
        scores[name] = {"acc": out["results"]["stem_tiny_mc"]["acc,none"],
                        "ll": [[r[0] for r in s["filtered_resps"]] for s in out["samples"]["stem_tiny_mc"]]}
    return scores


@pytest.mark.slow
def test_a_tp2_pp2_run_exports_to_transformers_and_lm_eval(runs, tmp_path, monkeypatch):
    """4 ranks (TP=2 x PP=2), STEM-1/3 with host tables, 8 steps, exported (tests/runs.py); ``stem-export-hf`` on
    the export."""
    run = runs.shared("parallel=tp2", "parallel.pipeline_model_parallel_size=2", "model.num_layers=4", nproc=4).out_dir
    proc = subprocess.run([sys.executable, "-m", "stem_megatron.export.hf.cli", str(run / "export"),
                           str(tmp_path / "hf")], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"wrote {tmp_path / 'hf'}: load it with AutoModelForCausalLM.from_pretrained(")
    (got,) = distributed.run(_against_stem_generate, 1, run / "export", tmp_path / "hf")
    assert got["diff"] <= BOUND
    assert [_cut_at_eod(t) for t in got["theirs"]] == got["ours"] == [_cut_at_eod(t) for t in got["batched"]]
    for key, value in {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                       "HF_DATASETS_CACHE": str(tmp_path / "datasets")}.items():
        monkeypatch.setenv(key, value)  # the spawned worker inherits them
    (scores,) = distributed.run(_score_both, 1, run / "export", tmp_path / "hf")
    assert scores["hf"]["acc"] == scores["ours"]["acc"]
    assert len(scores["hf"]["ll"]) == 8
    for a, b in zip(scores["hf"]["ll"], scores["ours"]["ll"]):
        assert a == pytest.approx(b, abs=BOUND)


def _tables_at_home(hf_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True, stem_tables_on_host=True)
    model.to(torch.float64)
    cast = model.model.layers[2].mlp.U_l.weight.dtype
    model.to("meta")  # any device but the host's: the tables stay
    return {"cast": str(cast), "table": str(model.model.layers[2].mlp.U_l.weight.device),
            "rest": str(model.model.layers[2].mlp.W_g.weight.device)}


def _bad_inputs(corpus, tmp: Path) -> list[str]:
    """What ``stem-export-hf`` says (its SystemExit) for a missing export, a damaged one, a Hash-MoE one and an
    existing output directory; the output directories that exist afterwards."""
    from stem_megatron.config import HashMoEConfig
    from stem_megatron.export.format import write_export
    from stem_megatron.export.hf.cli import main

    damaged = tmp / "damaged"
    damaged.mkdir()
    (damaged / "config.json").write_text("{}")
    (damaged / "model.pt").write_bytes(b"not a torch archive")
    cfg = tiny_config(corpus, 2, 32, variant="hash_moe", ratio="1/2",
                      hash_moe=HashMoEConfig(num_experts=4, expert_ffn_hidden_size=32))
    write_export(tmp / "moe", cfg, perturbed_weights(cfg), corpus / "tokenizer.json")
    (tmp / "taken").mkdir()
    said = []
    for export, out in (("nowhere", "hf"), ("damaged", "hf"), ("moe", "hf"), ("moe", "taken")):
        try:
            main([str(tmp / export), str(tmp / out)])
        except SystemExit as e:
            said.append(str(e.code))
    return said + sorted(p.name for p in tmp.iterdir() if "hf" in p.name)


@pytest.mark.slow
def test_bad_input_is_one_line(corpus, tmp_path):
    (said,) = distributed.run(_bad_inputs, 1, corpus, tmp_path)
    nowhere, damaged, moe, taken, *left = said
    assert nowhere == (f"stem-export-hf: error: export directory {tmp_path / 'nowhere'} does not exist (a run "
                       "writes one with checkpoint.export=DIR)")
    assert len(damaged.splitlines()) == 1 and "model.pt is corrupt or truncated" in damaged
    assert damaged.endswith("re-export it")
    assert moe == (f"stem-export-hf: error: {tmp_path / 'moe'} is a Hash-MoE model, which the Hugging Face format "
                   "does not hold (its experts are routed by a token hash): export a dense or STEM model")
    assert taken == f"stem-export-hf: error: {tmp_path / 'taken'} already exists: remove it or choose another --out"
    assert left == []  # nothing half-written
