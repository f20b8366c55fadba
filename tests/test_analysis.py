"""Analysis tools: ``tools/capacity_scaling.py`` (paper §3.2) and ``tools/angular_spread.py`` (Fig. 4)
on the synthetic corpus and a tiny random export: they run, write plots + JSON, and the numbers are sane.

The angular-spread tool runs megatron's model, so it runs in a spawned process; the capacity tool only
reads an indexed dataset and a config, so it runs in-process (and against a hand computation).
"""

import dataclasses
import importlib.util
import json
from pathlib import Path

import distributed
import numpy as np
import pytest
from conftest import VOCAB
from tiny_export import D_FF, tiny_config, write_tiny_export

ROOT = Path(__file__).resolve().parents[1]
SEQ = 64


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_exports(corpus, out):
    """A STEM (ratio full: layers 1, 2) and a dense tiny export."""
    for variant in ("stem", "dense"):
        write_tiny_export(tiny_config(corpus, 3, SEQ, variant=variant), out / variant)


def _exports_then_angular_spread(corpus, out):
    """In one spawned process (one megatron start-up): write the exports, run the tool's ``main``."""
    import contextlib
    import io

    _write_exports(corpus, out)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        _tool("angular_spread").main(["--export", str(out / "stem"), "--dense-export", str(out / "dense"),
                                      "--data", str(corpus / "valid"), "--num-tokens", "64", "--windows", "4",
                                      "--out-dir", str(out)])
    return printed.getvalue()


# ----------------------------------------------------------------------------------- capacity
def test_capacity_counts_by_hand():
    cap = _tool("capacity_scaling")
    tokens = np.array([1, 1, 2, 3, 3, 3, 4, 1, 5, 5, 5, 5, 6, 7, 8, 9])
    assert cap.distinct_per_window(tokens, 4).tolist() == [3, 3, 1, 4]
    result = cap.capacity_scaling(tokens, [4, 8, 16, 32], d_ff=10, stem_layers=3, vocab_size=20)
    rows = {r["context_length"]: r for r in result["lengths"]}
    assert result["skipped_lengths"] == [32] and set(rows) == {4, 8, 16}
    assert rows[4]["mean_unique"] == 2.75 and rows[8]["mean_unique"] == 4.5 and rows[16]["mean_unique"] == 9
    assert rows[16]["activated_stem_params"] == 9 * 10 * 3 and rows[16]["table_rows_touched_fraction"] == 9 / 20


def test_capacity_scaling_tool_on_corpus(corpus, tmp_path, capsys):
    """In-process (counting needs no model; ``--export`` only reads config.json, so a config-only dir serves)."""
    cap = _tool("capacity_scaling")
    config_only = tmp_path / "export"
    config_only.mkdir()
    (config_only / "config.json").write_text(json.dumps(dataclasses.asdict(tiny_config(corpus, 3, SEQ))))
    assert cap.main(["--data", str(corpus / "train"), "--export", str(config_only), "--lengths",
                     "8,16,32,64,128,256,100000", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Heaps fit" in out
    result = json.loads((tmp_path / "capacity_scaling.json").read_text())
    assert (tmp_path / "capacity_scaling.png").stat().st_size > 0
    assert (result["d_ff"], result["stem_layers"], result["vocab_size"]) == (D_FF, 2, VOCAB)
    rows = result["lengths"]
    assert [r["context_length"] for r in rows] == [8, 16, 32, 64, 128, 256] and result["skipped_lengths"] == [100000]
    means = [r["mean_unique"] for r in rows]
    assert all(a <= b for a, b in zip(means, means[1:]))  # nondecreasing in L
    assert all(1 <= r["min_unique"] <= r["mean_unique"] <= min(r["max_unique"], r["context_length"], VOCAB)
               for r in rows)
    assert all(r["activated_stem_params"] == pytest.approx(r["mean_unique"] * D_FF * 2) for r in rows)
    assert 0 < result["heaps_fit"]["beta"] <= 1


# ------------------------------------------------------------------------------- angular spread
@pytest.mark.slow
def test_angular_spread_tool(corpus, tmp_path):
    (out,) = distributed.run(_exports_then_angular_spread, 1, corpus, tmp_path)
    assert "stem_rows/layer1" in out
    result = json.loads((tmp_path / "angular_spread.json").read_text())
    assert (tmp_path / "angular_spread.png").stat().st_size > 0
    groups = result["groups"]
    assert {"stem_rows/layer1", "stem_rows/layer2", "stem_gated/layer1", "up_proj/layer0",
            "dense_up_proj/layer0", "dense_up_proj/layer1", "dense_up_proj/layer2"} <= set(groups)
    n = result["num_tokens"]
    assert 2 <= n <= 64 and len(set(result["token_ids"])) == n and all(0 <= t < VOCAB for t in result["token_ids"])
    for name, g in groups.items():
        q = [g["quantiles"][k] for k in sorted(g["quantiles"], key=float)]
        assert g["pairs"] == n * (n - 1) // 2 == sum(g["histogram"]["counts"]), name
        assert -1 <= g["min"] <= q[0] and q == sorted(q) and q[-1] <= g["max"] <= 1, name
        assert -1 <= g["mean"] <= 1 and 0 <= g["mean_abs"] <= 1 and 0 < g["std"] <= 1, name
        assert 0 <= g["mean_angle_deg"] <= 180, name
    # random tables: rows are nearly orthogonal (|cos| ~ 1/sqrt(d_ff)), the paper's large angular spread
    assert abs(groups["stem_rows/layer1"]["mean"]) < 0.05 and groups["stem_rows/layer1"]["std"] < 0.2
