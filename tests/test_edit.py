"""Knowledge editing (``stem_megatron/edit/``): row copies/swaps with a bitwise undo, the token-length
mismatch strategies, the swap's effect on a STEM layer's MLP output, and the ``stem-edit`` CLI.

Model code runs in a spawned process (``distributed.run``): megatron on CPU installs a global torch
function mode and process group that must not leak into the pytest process. Table-only checks run here.
"""

import contextlib
import io
import json

import distributed
import pytest
import torch
from conftest import VOCAB
from tiny_export import D_FF, D, tiny_config, write_tiny_export

from stem_megatron.edit import StemEditor, load_log, plan_rows

SEQ = 32


def _tables(layers=(1, 2, 4), V=50, d_ff=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {layer: torch.randn(V, d_ff, generator=g) for layer in layers}


# ------------------------------------------------------------------------------- tables only (fast)
def test_edit_then_undo_restores_every_row_bitwise(tmp_path):
    tables = _tables()
    original = {k: t.clone() for k, t in tables.items()}
    editor = StemEditor(tables)
    assert editor.layers == [1, 2, 4] and (editor.vocab_size, editor.d_ff) == (50, 8)

    editor.swap_rows([3, 7], [11, 12])  # all layers
    for layer in (1, 2, 4):
        assert torch.equal(tables[layer][3], original[layer][11]) and torch.equal(tables[layer][11], original[layer][3])
        assert torch.equal(tables[layer][7], original[layer][12]) and torch.equal(tables[layer][12], original[layer][7])
    editor.copy_rows([5], [6, 8], layers="1,4", strategy="average")  # two layers, a float mix
    assert torch.equal(tables[2][5], original[2][5])
    assert torch.allclose(tables[4][5], (original[4][6] + original[4][8]) / 2, atol=1e-6)
    editor.copy_rows([3], [20], layers=[2])  # overwrites an already-edited row
    editor.swap_rows([30, 31, 32], [40], strategy="clone")
    changed = sum(int((tables[k] != original[k]).any(dim=1).sum()) for k in tables)
    assert changed > 0 and len(editor.log) == 4

    # the log round-trips exactly through both formats and re-applies to a fresh copy
    edited = {k: t.clone() for k, t in tables.items()}
    for name in ("log.json", "log.pt"):
        fresh = {k: t.clone() for k, t in original.items()}
        StemEditor(fresh).redo_log(load_log(editor.save_log(tmp_path / name)))
        assert all(torch.equal(fresh[k], edited[k]) for k in tables), name

    assert editor.undo(1) == 1 and len(editor.log) == 3
    assert editor.undo() == 3 and editor.log == []
    assert all(torch.equal(tables[k], original[k]) for k in tables)  # bitwise

    with editor.session():
        editor.swap_rows([1], [2])
        assert not torch.equal(tables[1][1], original[1][1])
    assert all(torch.equal(tables[k], original[k]) for k in tables) and editor.log == []


def test_edit_rejects_bad_requests():
    editor = StemEditor(_tables())
    with pytest.raises(ValueError, match="not STEM layers"):
        editor.copy_rows([1], [2], layers=[3])
    with pytest.raises(ValueError, match="outside the tables' vocabulary"):
        editor.copy_rows([1], [50])
    with pytest.raises(ValueError, match="written twice"):
        editor.swap_rows([1, 2], [2, 3])
    with pytest.raises(ValueError, match="not one of"):
        plan_rows([1], [2], "stretch")
    with pytest.raises(ValueError, match="two different rows"):
        plan_rows([1, 1], [2, 3])
    with pytest.raises(ValueError, match="no STEM tables"):
        StemEditor({})
    assert editor.log == []


@pytest.mark.parametrize("strategy", ["filler", "clone", "average"])
def test_length_strategies(strategy):
    V, filler = 50, 0
    tables = _tables(V=V)
    original = {k: t.clone() for k, t in tables.items()}
    expected = {  # (source ids, target ids) -> the row mix of each source id, per the strategy's definition
        "filler": {((1, 2, 3), (10,)): [{10: 1}, {0: 1}, {0: 1}],
                   ((1,), (10, 11, 12)): [{10: 1}],
                   ((1, 2), (10, 11)): [{10: 1}, {11: 1}]},
        "clone": {((1, 2, 3), (10,)): [{10: 1}, {10: 1}, {10: 1}],
                  ((1, 2), (10, 11, 12)): [{10: 1}, {12: 1}],
                  ((1, 2), (10, 11)): [{10: 1}, {11: 1}]},
        "average": {((1, 2, 3), (10,)): [{10: 1}, {10: 1}, {10: 1}],
                    ((1,), (10, 11, 12)): [{10: 1 / 3, 11: 1 / 3, 12: 1 / 3}],
                    ((1, 2), (10, 11, 12)): [{10: 0.5, 11: 0.5}, {12: 1}],
                    ((1, 2, 3, 4, 5), (10, 11)): [{10: 1}, {10: 1}, {10: 1}, {11: 1}, {11: 1}]},
    }[strategy]
    for (src, tgt), mixes in expected.items():
        plan = plan_rows(src, tgt, strategy, filler)
        assert [dst for dst, _ in plan.assignments] == list(src)
        got = [mix for _, mix in plan.assignments]
        assert [sorted(m) for m in got] == [sorted(m) for m in mixes]
        for g, m in zip(got, mixes):
            assert all(g[k] == pytest.approx(m[k]) for k in m) and sum(g.values()) == pytest.approx(1)
        assert all(0 <= i < V for _, mix in plan.assignments for i in mix)
        used = {i for _, mix in plan.assignments for i in mix}
        assert sorted(plan.dropped) == sorted(set(tgt) - used)

        editor = StemEditor(tables)
        record = editor.apply_plan(plan, "copy", layers=[2, 4])
        assert record.before.shape == record.after.shape == (2, len(src), 8)
        for layer in (2, 4):
            for dst, mix in zip(src, mixes):
                want = sum(w * original[layer][i].double() for i, w in mix.items()).float()
                torch.testing.assert_close(tables[layer][dst], want, rtol=0, atol=1e-6)
        assert torch.equal(tables[1], original[1])
        editor.undo()
        assert all(torch.equal(tables[k], original[k]) for k in tables)

    # a swap writes the target ids too, never the filler token's row
    editor = StemEditor(tables)
    editor.apply_plan(plan_rows([1, 2, 3], [10], strategy, filler), "swap")
    assert torch.equal(tables[1][10], original[1][1])
    assert torch.equal(tables[1][filler], original[1][filler])
    editor.undo()


# ------------------------------------------------------------------------------ the model (spawned)
def _model_checks(corpus, out_dir):
    from stem_megatron.edit.cli import knowledge_edit, main
    from stem_megatron.export.format import read_export
    from stem_megatron.inference.generate import generate_batch
    from stem_megatron.inference.model import InferenceModel
    from stem_megatron.model.token_context import token_ids

    export = out_dir / "tiny"
    write_tiny_export(tiny_config(corpus, 3, SEQ), export)  # here: one megatron start-up for the whole test
    model = InferenceModel(export, device="cpu")
    editor = StemEditor.from_model(model)
    assert editor.layers == [1, 2] and (editor.vocab_size, editor.d_ff) == (VOCAB, D_FF)
    originals = {k: t.clone() for k, t in editor.tables.items()}
    dense_before = {n: p.detach().clone() for n, p in model.model.named_parameters() if "U_l" not in n}
    a, b = 17, 42
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 1, D, generator=g).expand(2, 1, D).contiguous()  # the same hidden input at both positions
    tokens = torch.tensor([[a, b]])

    def mlp_out(layer):
        with torch.no_grad(), token_ids(tokens, VOCAB):
            return model.model.decoder.layers[layer].mlp(x)[0][:, 0]  # [2, D]: rows for a, b

    before = {layer: mlp_out(layer) for layer in (0, 1, 2)}
    prompt = torch.tensor([[5, a, 9, 3, b, 7]])
    logits_before = model.logits(prompt)

    editor.swap_rows([a], [b])  # all STEM layers
    for layer in (1, 2):  # the STEM MLP now computes for a what it computed for b, and vice versa
        after = mlp_out(layer)
        torch.testing.assert_close(after[0], before[layer][1], rtol=0, atol=1e-6)
        torch.testing.assert_close(after[1], before[layer][0], rtol=0, atol=1e-6)
    assert torch.equal(mlp_out(0), before[0])  # the dense layer-0 MLP does not read the tables
    assert not torch.allclose(model.logits(prompt), logits_before)
    editor.undo()
    assert all(torch.equal(editor.tables[k], originals[k]) for k in originals)
    assert torch.equal(model.logits(prompt), logits_before)

    editor.copy_rows([a], [b], layers=[2])  # one layer only
    assert torch.equal(mlp_out(1), before[1])
    torch.testing.assert_close(mlp_out(2)[0], before[2][1], rtol=0, atol=1e-6)
    editor.undo()
    assert all(torch.equal(p, dense_before[n]) for n, p in model.model.named_parameters() if "U_l" not in n)

    # host-resident tables are edited the same way (not behind a hot-row cache: its copies would go stale)
    host = InferenceModel(export, placement="host")
    host_editor = StemEditor.from_model(host)
    assert host_editor.layers == [1, 2] and host_editor.tables[1] is host.host_tables.tables[2]
    greedy = generate_batch(host, [[5, a, 9]], 4).tokens
    host_editor.copy_rows([a], [b])
    assert torch.equal(host.host_tables.tables[2][a], originals[1][b])
    host_editor.undo()
    assert generate_batch(host, [[5, a, 9]], 4).tokens == greedy
    with pytest.raises(ValueError, match="hot-row cache"):
        StemEditor.from_model(InferenceModel(export, placement="host", cache_rows=8))

    # Fig. 5 report on words of the test tokenizer, then the CLI (JSON, plot, log, edited export)
    report, ed = knowledge_edit(model, " heap", " queue", "the heap queue sorts", top_k=3)
    assert [len(report[k]) for k in ("original", "target_run", "edited")] == [3, 3, 3]
    assert report["target_prompt"] == "the queue queue sorts" and not report["warnings"]
    assert all(0 <= r["prob"] <= 1 for k in ("original", "target_run", "edited") for r in report[k])
    assert report["edited"] != report["original"]
    ed.undo()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(["--export", str(export), "--source", " heap", "--target", " tuples", "--prompt", "the heap queue",
              "--mode", "copy", "--layers", "2", "--length-strategy", "clone", "--top-k", "4", "--json",
              "--plot", str(out_dir / "edit.png"), "--save-log", str(out_dir / "edits.json"),
              "--save-edited", str(out_dir / "edited")])
    cli = json.loads(printed.getvalue())
    _, weights, _ = read_export(out_dir / "edited")
    log = load_log(out_dir / "edits.json")
    src = cli["rows_written"]
    assert cli["layers"] == [2] and len(log) == 1 and log[0].ids == src
    assert torch.equal(weights["decoder.layers.2.mlp.U_l.weight"][src], log[0].after[0])
    assert torch.equal(weights["decoder.layers.1.mlp.U_l.weight"], originals[1])
    return {"report": report, "cli": cli}


@pytest.mark.slow
def test_swap_moves_stem_mlp_outputs_and_cli(corpus, tmp_path):
    (out,) = distributed.run(_model_checks, 1, corpus, tmp_path)
    assert (tmp_path / "edit.png").stat().st_size > 0
    assert out["cli"]["mode"] == "copy" and len(out["cli"]["edited"]) == 4
