"""Evaluation of a single-process export, offline: the export format (round trip, damaged files, wrong
weights), the lm-eval adapter against the model's own log-softmax, a local lm-eval task end to end,
Needle-in-a-Haystack placement and scoring, and the ``stem-eval`` CLI.

Model code runs in spawned processes (``distributed.run`` or a subprocess): megatron on CPU installs
a global torch function mode and process group that must not leak into the pytest process.
"""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import distributed
import numpy as np
import pytest
import torch
from conftest import VOCAB
from tiny_export import perturbed_weights, tiny_config, write_tiny_export

DATA = Path(__file__).parent / "data"
SEQ = 256  # room for a NIAH prompt: with the 400-id test tokenizer the needle + question take ~80 tokens
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
TEXT = "The heap queue sorts tuples by key; def f(x): return x ** 2 # a naïve comment über the heap.\n"


@pytest.fixture(scope="module")
def export_dir(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "tiny"
    distributed.run(write_tiny_export, 1, tiny_config(corpus, 2, SEQ), out)  # layer 1 is STEM
    return out


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No hub access, and a private datasets cache (spawned workers inherit the environment)."""
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))


# ------------------------------------------------------------------------------------------ (a) format
def _export_checks(corpus, export, tmp):
    from stem_megatron.config import HashMoEConfig
    from stem_megatron.export.format import FORMAT, ExportError, read_export, write_export
    from stem_megatron.inference.model import InferenceModel

    cfg, weights, tokenizer = read_export(export)
    assert cfg == tiny_config(corpus, 2, SEQ)
    assert tokenizer == export / "tokenizer.json" and tokenizer.read_bytes() == (corpus / "tokenizer.json").read_bytes()
    U = weights["decoder.layers.1.mlp.U_l.weight"]
    assert U.shape == (VOCAB, 96)  # a full V x d_ff table, as with host_tables.placement=device
    model = InferenceModel(export)
    loaded = dict(model.model.named_parameters())
    assert set(loaded) == set(weights) and all(torch.equal(loaded[n], w) for n, w in weights.items())
    with pytest.raises(FileExistsError, match="already exists"):
        write_export(export, cfg, weights)
    assert not list(export.parent.glob(".tiny.tmp-*"))  # nothing left behind by the refused write

    damaged = tmp / "truncated"
    shutil.copytree(export, damaged)
    data = (damaged / "model.pt").read_bytes()
    (damaged / "model.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ExportError, match="corrupt or truncated"):
        read_export(damaged)
    (damaged / "model.pt").unlink()
    with pytest.raises(ExportError, match="model.pt is missing"):
        read_export(damaged)
    torch.save({"format": "something-else", "weights": weights}, damaged / "model.pt")
    with pytest.raises(ExportError, match=f"expected '{FORMAT}'"):
        read_export(damaged)

    wrong = dict(weights)
    del wrong["output_layer.weight"]
    wrong["decoder.layers.7.mlp.U_l.weight"] = U
    wrong["decoder.layers.1.mlp.U_l.weight"] = U[:, :48]  # one TP shard instead of the full table
    write_export(tmp / "wrong", cfg, wrong)
    with pytest.raises(ExportError) as err:
        read_export(tmp / "wrong")
    message = str(err.value)
    assert "missing (1): output_layer.weight" in message
    assert "unexpected (1): decoder.layers.7.mlp.U_l.weight" in message
    assert "decoder.layers.1.mlp.U_l.weight: (400, 48) != expected (400, 96)" in message

    # Hash-MoE with a frequency map: the counts travel inside the export
    counts = tmp / "counts.npy"
    np.save(counts, np.arange(VOCAB, dtype=np.int64))
    moe = tiny_config(corpus, 2, SEQ, variant="hash_moe", ratio="1/2",
                      hash_moe=HashMoEConfig(num_experts=4, expert_ffn_hidden_size=32, hash_map=f"frequency:{counts}"))
    moe_weights = perturbed_weights(moe)
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight" in moe_weights
    write_export(tmp / "moe", moe, moe_weights)
    counts.unlink()
    moe_cfg, _, _ = read_export(tmp / "moe")
    assert moe_cfg.hash_moe.hash_map == f"frequency:{tmp / 'moe' / 'hash_counts.npy'}"
    ids = InferenceModel(tmp / "moe").encode(TEXT)
    assert len(ids) > 10


@pytest.mark.slow
def test_export_round_trip_and_clear_errors(corpus, export_dir, tmp_path):
    distributed.run(_export_checks, 1, corpus, export_dir, tmp_path)


# ----------------------------------------------------------------------------------- (b) adapter
def _reference_loglikelihood(model, context_ids, continuation_ids):
    """Independent: one forward over the concatenation (left-truncated), log_softmax, sum, argmax check."""
    ids = (context_ids + continuation_ids)[-(model.seq_length + 1):]
    logprobs = torch.log_softmax(model.logits(torch.tensor([ids[:-1]]))[0], dim=-1)
    n = len(continuation_ids)
    rows = logprobs[len(ids) - 1 - n:]
    target = torch.tensor(continuation_ids)
    return float(rows.gather(1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())


def _adapter_checks(export):
    from lm_eval.api.instance import Instance

    from stem_megatron.eval.lm_adapter import STEMLM
    from stem_megatron.inference.model import InferenceModel

    model = InferenceModel(export)
    lm = STEMLM(model=model, batch_size=3)
    encode, eod = model.encode, model.eod_id
    pairs = [("The heap queue", " sorts tuples by key"), ("", "def f(x): return"),
             ("def f(x):", " return x ** 2"), (TEXT * 12, " the heap")]  # the last context exceeds seq_length
    assert len(encode(pairs[-1][0])) > SEQ
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)])
    for (context, continuation), (logprob, greedy) in zip(pairs, got):
        if context:  # lm-eval's convention: the context's trailing whitespace belongs to the continuation
            stripped = context.rstrip()
            context, continuation = stripped, context[len(stripped):] + continuation
            ctx = encode(context)
            cont = encode(context + continuation)[len(ctx):]
        else:
            ctx, cont = [eod], encode(continuation)
        ref_logprob, ref_greedy = _reference_loglikelihood(model, ctx, cont)
        assert (logprob, greedy) == (pytest.approx(ref_logprob, abs=1e-5), ref_greedy), (context, continuation)
        assert logprob < 0

    # is_greedy: a continuation made of the model's own argmax tokens is greedy, one changed token is not
    ctx = encode("The heap queue sorts")
    greedy_ids = []
    for _ in range(3):
        logits = model.logits(torch.tensor([ctx + greedy_ids]))[0, -1]
        greedy_ids.append(int(logits.argmax()))
    assert model.loglikelihood(ctx, greedy_ids)[1] is True
    assert lm._loglikelihood_tokens([(None, ctx, greedy_ids)])[0][1] is True
    assert model.loglikelihood(ctx, greedy_ids[:2] + [(greedy_ids[2] + 1) % 300])[1] is False

    # rolling: short text = every token scored from the EOD prefix; long text = lm-eval's two windows
    short, long = encode(TEXT * 2), encode(TEXT * 14)
    assert len(short) < SEQ < len(long) < 2 * SEQ
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (TEXT * 2,), 0),
                                        Instance("loglikelihood_rolling", {}, (TEXT * 14,), 1)])
    logprobs = torch.log_softmax(model.logits(torch.tensor([[eod] + short[:-1]]))[0], -1)
    assert rolling[0] == pytest.approx(float(logprobs.gather(1, torch.tensor(short)[:, None]).sum()), abs=1e-4)
    first = _reference_loglikelihood(model, [eod], long[:SEQ])[0]
    rest = len(long) - SEQ  # scored with the SEQ tokens before each of them as context
    second = _reference_loglikelihood(model, long[:SEQ], long[SEQ:])[0]
    assert rest > 0 and rolling[1] == pytest.approx(first + second, abs=1e-4)

    # generate_until: greedy decoding over the tokenizer's ids, cut at the stop string
    context = "def f(x):"
    (text,) = lm.generate_until([Instance("generate_until", {}, (context, {"until": ["\n"], "max_gen_toks": 6}), 0)])
    ids, decodable = encode(context), model.tokenizer.vocab_size
    expected = []
    for _ in range(6):
        token = int(model.logits(torch.tensor([ids + expected]))[0, -1, :decodable].argmax())
        if token == eod:
            break
        expected.append(token)
        if "\n" in model.decode(expected):
            break
    assert text == model.decode(expected).split("\n")[0]
    sample = [model.generate(ids, 8, temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(s))
              for s in (5, 5, 6)]
    assert sample[0] == sample[1] != sample[2] and max(sample[0]) < decodable

    # NIAH on the real tiny model: grid structure and finite answer log-likelihoods
    from stem_megatron.eval.niah import haystack_ids, run_niah

    hay = haystack_ids(Path(model.config.data.dir) / "valid", model.tokenizer)
    results = run_niah(model, hay, [160, 240], [0.0, 0.5, 1.0], max_new_tokens=4)
    assert results["lengths"] == [160, 240] and results["depths"] == [0.0, 0.5, 1.0]
    assert np.array(results["accuracy"]).shape == (2, 3) and len(results["cases"]) == 6
    assert all(0.0 <= a <= 1.0 for row in results["accuracy"] for a in row)
    assert all(math.isfinite(x) and x < 0 for row in results["answer_logprob"] for x in row)
    with pytest.raises(ValueError, match="exceed model.seq_length"):
        run_niah(model, hay, [SEQ], [0.5])


@pytest.mark.slow
def test_adapter_equals_model_log_softmax(export_dir):
    distributed.run(_adapter_checks, 1, export_dir)


# ------------------------------------------------------------------------------ (c) lm-eval task
def _harness_checks(export):
    from stem_megatron.eval.lm_adapter import STEMLM
    from stem_megatron.eval.tasks import run_tasks
    from stem_megatron.inference.model import InferenceModel

    model = InferenceModel(export)
    out = run_tasks(STEMLM(model=model, batch_size=4), task_files=[str(DATA / "mc_task.yaml")], log_samples=True)
    docs = [json.loads(line) for line in (DATA / "mc_task.jsonl").read_text().splitlines()]
    samples = out["samples"]["stem_tiny_mc"]
    assert out["n-samples"]["stem_tiny_mc"]["effective"] == len(docs) == len(samples) == 8
    accuracy = out["results"]["stem_tiny_mc"]["acc,none"]
    assert 0.0 <= accuracy <= 1.0
    correct = 0
    for sample in samples:
        doc = sample["doc"]
        ctx = model.encode(doc["question"])
        mine = [_reference_loglikelihood(model, ctx, model.encode(doc["question"] + " " + c)[len(ctx):])[0]
                for c in doc["choices"]]
        harness = [resp[0] for resp in sample["filtered_resps"]]
        assert harness == pytest.approx(mine, abs=1e-5)
        assert int(np.argmax(harness)) == int(np.argmax(mine))
        correct += int(np.argmax(mine)) == doc["label"]
    assert accuracy == pytest.approx(correct / len(docs))


@pytest.mark.slow
def test_local_task_scored_by_lm_eval_offline(export_dir, offline):
    distributed.run(_harness_checks, 1, export_dir)


# -------------------------------------------------------------------------------------- (d) NIAH
@pytest.fixture(scope="module")
def tokenizer_and_haystack(corpus):
    from stem_megatron.data.tokenizer import HFTokenizer
    from stem_megatron.eval.niah import haystack_ids

    tokenizer = HFTokenizer(corpus / "tokenizer.json")
    return tokenizer, haystack_ids(corpus / "valid", tokenizer)


@pytest.mark.parametrize("length", [256, 512])
def test_niah_places_needle_at_depth(tokenizer_and_haystack, length):
    from stem_megatron.eval.niah import NEEDLE, QUESTION, boundary_window, make_cases

    tokenizer, hay = tokenizer_and_haystack
    cases = make_cases(tokenizer, hay, [length], [0.0, 0.5, 1.0], samples=2, seed=3)
    assert len(cases) == 6
    for case in cases:
        prompt = case.prompt_ids
        needle, question = tokenizer.tokenize(NEEDLE.format(number=case.number)), tokenizer.tokenize(QUESTION)
        assert len(prompt) == length and case.haystack_tokens == length - len(needle) - len(question)
        assert prompt[case.needle_start:case.needle_start + len(needle)] == needle
        assert prompt[-len(question):] == question
        target = case.depth * case.haystack_tokens
        assert abs(case.needle_start - target) <= boundary_window(case.haystack_tokens)
        if case.depth in (0.0, 1.0):
            assert case.needle_start == target
        else:  # moved to a sentence end or a word start
            before = tokenizer.detokenize([prompt[case.needle_start - 1]])
            after = tokenizer.detokenize([prompt[case.needle_start + len(needle)]])
            assert before.rstrip()[-1:] in (".", "!", "?") or before.endswith("\n") or after[:1].isspace()
    assert len({c.number for c in cases}) == 6


def test_niah_scorer(tokenizer_and_haystack):
    from stem_megatron.eval.niah import make_cases, score_cases

    tokenizer, hay = tokenizer_and_haystack
    cases = make_cases(tokenizer, hay, [200, 300], [0.0, 0.5, 1.0], samples=2)
    number = {tuple(c.prompt_ids): c for c in cases}

    def right(ids):
        return f" {number[tuple(ids)].number}. And more text 123"

    def wrong(ids):
        return f" {int(number[tuple(ids)].number) + 1}."

    def shallow_only(ids):  # right at depth 0, says nothing elsewhere
        return right(ids) if number[tuple(ids)].depth == 0.0 else " I do not know"

    assert score_cases(cases, right)["accuracy"] == [[1.0, 1.0, 1.0]] * 2
    assert score_cases(cases, wrong)["accuracy"] == [[0.0, 0.0, 0.0]] * 2
    results = score_cases(cases, shallow_only, loglikelihood=lambda ctx, cont: (-1.5 * len(cont), False))
    assert results["accuracy"] == [[1.0, 0.0, 0.0]] * 2 and results["mean_accuracy"] == pytest.approx(1 / 3)
    assert results["answer_logprob"] == [[-1.5 * len(tokenizer.tokenize(f" {cases[0].number}"))] * 3] * 2
    assert [r["predicted"] for r in results["cases"][2:4]] == [None, None]


def test_held_out_accuracy_equals_an_independent_argmax(export_dir, corpus):
    from stem_megatron.eval.perplexity import held_out_perplexity, token_windows
    from stem_megatron.inference.model import InferenceModel

    model = InferenceModel(export_dir, device="cpu")
    got = held_out_perplexity(model, corpus / "valid", batch_size=3, max_windows=5)
    windows = torch.from_numpy(np.stack(list(token_windows(corpus / "valid", model.seq_length))[:5]))
    logits = model.logits(windows[:, :-1])
    assert got["accuracy"] == pytest.approx(float((logits.argmax(-1) == windows[:, 1:]).float().mean()), abs=0)


# --------------------------------------------------------------------------------------- (e) CLI
@pytest.mark.slow
def test_stem_eval_cli_end_to_end(export_dir, corpus, tmp_path):
    out, plot = tmp_path / "results.json", tmp_path / "niah.png"
    cmd = [sys.executable, "-m", "stem_megatron.eval.cli", "--export", str(export_dir),
           "--task-file", str(DATA / "mc_task.yaml"), "--limit", "5",
           "--niah", "--lengths", "160,240", "--depths", "0,0.5,1", "--max-new-tokens", "4", "--niah-plot", str(plot),
           "--ppl", "--data", str(corpus / "valid"), "--out", str(out)]
    env = os.environ | OFFLINE | {"HF_DATASETS_CACHE": str(tmp_path / "hf_datasets")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)  # data_files
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]  # resolve against the YAML, not cwd
    results = json.loads(out.read_text())
    task = results["lm_eval"]["results"]["stem_tiny_mc"]
    assert 0.0 <= task["acc,none"] <= 1.0 and results["lm_eval"]["n-samples"]["stem_tiny_mc"]["effective"] == 5
    assert np.array(results["niah"]["accuracy"]).shape == (2, 3) and plot.stat().st_size > 0
    ppl = results["perplexity"]
    assert ppl["tokens"] == ppl["windows"] * SEQ > 0 and math.isclose(ppl["ppl"], math.exp(ppl["nll"]))
    assert 1.0 < ppl["ppl"] < 10 * VOCAB  # a random model: near-uniform over the vocabulary
    assert results["config"]["model"]["seq_length"] == SEQ and "stem_tiny_mc" in proc.stdout


def test_cli_rejects_incomplete_requests(capsys):
    from stem_megatron.eval.cli import parse_args

    for argv, problem in ((["--export", "e", "--out", "r.json"], "nothing to evaluate"),
                          (["--export", "e", "--out", "r.json", "--ppl"], "--ppl needs --data"),
                          (["--export", "e", "--out", "r.json", "--niah"], "--niah needs --haystack")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert problem in capsys.readouterr().err
    assert parse_args(["--export", "e", "--out", "r", "--tasks", "paper"]).tasks[4] == "social_iqa"
