"""KV-cache generation (``stem_megatron/inference/generate.py``): equal to the recompute-everything
``InferenceModel.generate``; host-resident STEM rows equal on-device tables token for token (with and
without the hot-row cache); only the step's distinct rows are fetched; the per-step byte report
against a hand computation; the ``stem-generate`` CLI.

Model code runs in spawned processes (``distributed.run`` or a subprocess): megatron on CPU installs
a global torch function mode and process group that must not leak into the pytest process.
"""

import contextlib
import io
import json
import subprocess
import sys

import distributed
import pytest
import torch
from conftest import VOCAB
from tiny_export import D_FF, D, tiny_config, write_tiny_export

SEQ = 64
PROMPTS = ("def f(x): return", "The heap queue sorts tuples by key; def", "x")
NEW = 12


@pytest.fixture(scope="module")
def export_dir(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "tiny"
    distributed.run(write_tiny_export, 1, tiny_config(corpus, 3, SEQ), out)  # layers 1, 2 STEM
    return out


def _fed_tokens(prompts, new, max_new):
    """Independently: the ids each forward feeds (prefill: the shared prompt prefix; then one position
    for every row that still has a token to produce), when every row ran to ``max_new`` tokens."""
    seqs = [p + n for p, n in zip(prompts, new)]
    start = min(len(p) for p in prompts)
    steps = [[t for s in seqs for t in s[:start]]]
    for pos in range(start, max(len(p) for p in prompts) + max_new - 1):
        steps.append([s[pos] for p, s in zip(prompts, seqs) if pos <= len(p) + max_new - 2])
    return steps


# ----------------------------------------------------------------- (a) (b) (c) equality and fetches
def _generation_checks(export):
    from stem_megatron.inference.generate import generate_batch, generate_texts
    from stem_megatron.inference.model import InferenceModel

    reference = InferenceModel(export)
    device = InferenceModel(export, placement="device")
    host = InferenceModel(export, placement="host")
    cached = InferenceModel(export, placement="host", cache_rows=8, refresh_every=2)
    full_cache = InferenceModel(export, placement="host", cache_rows=VOCAB)
    assert host.host_tables is not None and host.host_tables.layers == [2, 3] and device.host_tables is None
    assert not any(n.endswith("U_l.weight") for n, _ in host.model.named_parameters())  # tables stay on the host
    prompts = [reference.encode(p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == 3

    # (a) KV cache + batch of three prompt lengths == recomputing the window for every token, per prompt
    expected = [reference.generate(p, NEW) for p in prompts]
    greedy = generate_batch(device, prompts, NEW)
    assert greedy.tokens == expected
    assert all(len(t) == NEW for t in expected)  # no EOD stop: _fed_tokens below relies on it
    seed = torch.Generator().manual_seed(11)
    assert generate_batch(device, [prompts[1]], NEW, temperature=1.0, top_p=0.9, generator=seed).tokens == [
        reference.generate(prompts[1], NEW, temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(11))]
    stop = [reference.decode(expected[0][1:3])]  # cuts prompt 0 after its third token; the others maybe
    stopped = generate_batch(device, prompts, NEW, stop=stop).tokens
    assert stopped == [reference.generate(p, NEW, stop=stop) for p in prompts] and len(stopped[0]) <= 3
    texts, _ = generate_texts(device, list(PROMPTS), 4)
    assert texts == [reference.decode(t[:4]) for t in expected]
    with pytest.raises(ValueError, match="exceeds model.seq_length"):
        generate_batch(device, [[1] * (SEQ - 3)], 5)

    # (b) host-resident rows == on-device tables, token for token, greedy and seeded sampling, cache on
    def sample(model, s):
        return generate_batch(model, prompts, NEW, temperature=1.0, top_p=0.9,
                              generator=torch.Generator().manual_seed(s))

    sampled = sample(device, 3)
    assert sampled.tokens != greedy.tokens and sample(device, 3).tokens == sampled.tokens
    results = {}
    for name, model in (("host", host), ("cached", cached), ("full_cache", full_cache)):
        results[name] = generate_batch(model, prompts, NEW)
        assert results[name].tokens == greedy.tokens, name
        assert sample(model, 3).tokens == sampled.tokens, name
    window = torch.tensor([prompts[1]])  # scoring and sliding-window generation fetch host rows too
    assert torch.equal(host.logits(window), device.logits(window)) and host.generate(prompts[0], NEW) == expected[0]

    # (c) each forward gathers exactly its distinct ids' rows (counted from the gathered tensors)
    fed = _fed_tokens(prompts, greedy.tokens, NEW)
    steps = results["host"].steps
    assert len(steps) == len(fed) and [r["batch"] for r in steps[1:]] == [len(f) for f in fed[1:]]
    assert [r["phase"] for r in steps] == ["prefill"] + ["decode"] * (len(fed) - 1)
    distinct = [len(set(f)) for f in fed]
    assert [r["rows_from_host"] for r in steps] == distinct
    assert [r["unique_tokens"] for r in steps] == distinct == [r["unique_tokens"] for r in greedy.steps]
    assert [r["rows_from_cache"] for r in steps] == [0] * len(fed)
    assert [r["bytes_to_device"] for r in steps] == [n * D_FF * 4 * 2 for n in distinct]  # 2 STEM layers
    assert max(distinct[1:]) <= 3 and min(distinct[1:]) >= 1
    for r, n in zip(results["cached"].steps, distinct):  # with the cache: hits + host rows = distinct ids
        assert r["rows_from_host"] + r["rows_from_cache"] == n
    assert sum(r["rows_from_cache"] for r in results["cached"].steps) > 0
    assert [r["rows_from_host"] for r in results["full_cache"].steps[1:]] == [0] * (len(fed) - 1)
    assert results["full_cache"].summary["cache_hit_rate"] == 1.0

    # (e) the CLI's text output (the JSON form runs as a subprocess below)
    from stem_megatron.inference.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(["--export", str(export), "--prompt", PROMPTS[0], "--prompt", PROMPTS[2], "--max-new-tokens", "3",
              "--placement", "device"])
    text = printed.getvalue()
    assert "=== [1] 'x'" in text and "STEM/dense" in text and "Table 1" in text
    return {"steps": steps, "summary": results["host"].summary}


@pytest.mark.slow
def test_kv_cache_and_host_rows_equal_reference(export_dir):
    (out,) = distributed.run(_generation_checks, 1, export_dir)
    assert out["summary"]["decode_steps"] == len(out["steps"]) - 1


# ----------------------------------------------------------------------------------- (d) byte report
def test_byte_report_matches_hand_computation(export_dir):
    from stem_megatron.flops.decode_bytes import ByteBudget
    from stem_megatron.flops.paper import table1

    weights = torch.load(export_dir / "model.pt", weights_only=True)["weights"]
    budget = ByteBudget.from_shapes({n: w.shape for n, w in weights.items()}, element_size=4)
    assert budget.stem_layers == (1, 2) and (budget.hidden_size, budget.ffn_hidden_size) == (D, D_FF)
    # by hand: per layer attention qkv 3*32*32 + proj 32*32 + two RMSNorms 2*32; layer 0 SwiGLU 3*32*96;
    # STEM layers W_g + W_d 2*32*96 each; final norm 32; output layer 400*32. No input embedding, no U_l.
    attention = 3 * 32 * 32 + 32 * 32 + 2 * 32
    weights_stem = 3 * attention + 3 * 32 * 96 + 2 * (2 * 32 * 96) + 32 + VOCAB * 32
    weights_dense = weights_stem + 2 * (32 * 96)  # the dense model adds W_u to both replaced layers
    assert budget.weight_bytes == 4 * weights_stem == 4 * 46816
    assert budget.dense_model_weight_bytes == 4 * weights_dense
    assert budget.table_bytes == 4 * 2 * VOCAB * 96
    for u in (1, 3, 7):
        step = budget.step(u)
        stem = 4 * (weights_stem + u * 32 + 2 * u * 96)  # + embedding rows + B_uniq rows in 2 STEM layers
        dense = 4 * (weights_dense + u * 32)
        assert (step["stem_bytes"], step["dense_model_bytes"]) == (stem, dense)
        assert step["stem_row_bytes"] == u * 96 * 4 * 2 and step["saved_bytes"] == dense - stem
        assert step["stem_over_dense"] == pytest.approx(stem / dense)
        # Table 1 decoding rows (per replaced layer, parameters x 4 bytes): 3 d d_ff vs 2 d d_ff + B_uniq d_ff
        paper = table1(D, D_FF, seq_length=1, batch=u, vocab_size=VOCAB)
        assert step["layer_dense_ffn_bytes"] == 4 * paper["decoding_parameter_loading"]["ffn"]
        assert step["layer_stem_ffn_bytes"] == 4 * paper["decoding_parameter_loading"]["stem"]
        assert step["layer_stem_row_bytes"] == 4 * u * D_FF
    # the dense model wins back its W_u only when a step touches more rows than d per layer
    assert budget.step(D)["saved_bytes"] == 0 and budget.step(D + 1)["saved_bytes"] < 0


# ------------------------------------------------------------------------------------------ (e) CLI
@pytest.mark.slow
def test_stem_generate_cli_end_to_end(export_dir, tmp_path):
    base = [sys.executable, "-m", "stem_megatron.inference.cli", "--export", str(export_dir),
            "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-new-tokens", "5", "--cache-rows", "4"]
    proc = subprocess.run(base + ["--json", "--temperature", "0.8", "--top-p", "0.9", "--seed", "5"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert [g["prompt"] for g in out["generations"]] == list(PROMPTS[:2])
    assert all(1 <= len(g["ids"]) <= 5 and isinstance(g["text"], str) for g in out["generations"])
    assert out["summary"]["placement"] == "host" and out["summary"]["stem_layers"] == 2
    assert out["steps"][0]["phase"] == "prefill" and out["steps"][0]["batch"] == 2
    for step in out["steps"]:
        assert step["rows_from_host"] + step["rows_from_cache"] == step["unique_tokens"] <= step["tokens"]
        assert step["stem_bytes"] < step["dense_model_bytes"]


def test_cli_rejects_bad_requests(capsys):
    from stem_megatron.inference.cli import parse_args

    for argv, problem in ((["--export", "e", "--max-new-tokens", "4"], "either as --prompt"),
                          (["--export", "e", "--prompt", "a", "--prompt-ids", "1", "--max-new-tokens", "4"],
                           "either as --prompt"),
                          (["--export", "e", "--prompt", "a", "--max-new-tokens", "4", "--placement", "device",
                            "--cache-rows", "8"], "--cache-rows needs --placement host"),
                          (["--export", "e", "--prompt-ids", "1,x", "--max-new-tokens", "4"], "comma-separated")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert problem in capsys.readouterr().err
    assert parse_args(["--export", "e", "--prompt-ids", "1, 2,3", "--max-new-tokens", "2"]).prompt_ids == [[1, 2, 3]]
