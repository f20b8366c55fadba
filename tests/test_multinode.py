"""Several nodes on this host (each its own host copy of the STEM tables, the node from the launcher, not from rank
order, each row owned by one node): runs on 2 and 4 nodes train as the same world on one node (losses, grad norms,
every weight and table row of the export), a checkpoint resumes on another node count and TP size, the work moved
beside the step (row gradients sent from backward, CPU Adam beside the next step) changes no bit, and owners' working
sets train bitwise like the host step. The nodes are emulated as torchrun's agents emulate them (``tests/runs.py``:
the rank's ``GROUP_RANK``); the launch itself is tested in tests/test_preemption.py (2 agents, a signal to one)."""

import json

import pytest
import torch
from runs import STEPS, train

SERIAL = ("host_tables.overlap_update=false", "host_tables.overlap_exchange=false")


def _close(a: list[dict], b: list[dict], key: str) -> float:
    assert len(a) == len(b) == STEPS
    return max(abs(x[key] - y[key]) for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.parametrize("parallel,nnodes,nproc,optimizer", [("dp2", 2, 1, "lazy"), ("tp2", 2, 2, "lazy"),
                                                              ("dp2", 4, 1, "dense")])
def test_nodes_train_as_one(runs, parallel, nnodes, nproc, optimizer):
    """2 nodes x DP, 2 nodes x TP=2 (DP=2 across the nodes) and 4 nodes x DP (AdamW on every row), each row
    owned by one node (fp32 wire), against the same world on one node, where the node's DP ranks share the
    rows: losses, grad norms, dense weights and every STEM table row within 1e-5 (only the order of the DP
    sums differs). One node against the plain on-device table: test_host_store; the owner mechanism
    against one table: test_row_ownership."""
    setting = (f"parallel={parallel}", f"host_tables.optimizer={optimizer}")
    one = runs.shared(*setting, nproc=nnodes * nproc)
    nodes = runs.shared(*setting, nodes=nnodes, nproc=nproc)
    got, ref = nodes.metrics, one.metrics
    assert _close(got, ref, "loss") < 1e-5 and _close(got, ref, "grad_norm") < 1e-5
    weights, one_weights = nodes.weights(), one.weights()
    assert weights.keys() == one_weights.keys() and any(".U_l." in name for name in weights)
    assert max((weights[n] - one_weights[n]).abs().max().item() for n in one_weights) < 1e-5
    assert all(r["stem_node_bytes_sent"] == 0 for r in ref)
    assert all(r["stem_node_bytes_sent"] > 0 and r["stem_node_rows_updated"] > 0 for r in got)


@pytest.mark.slow
def test_a_checkpoint_of_two_nodes_with_tp2_resumes_on_one_node_with_tp1_and_on_four(runs, tmp_path):
    """Saved at 2 nodes x TP=2 (DP=2 across the nodes) after 4 of 8 steps, continued on 1 node x TP=1 (one
    process) and on 4 nodes x DP (the dense weights and optimizer state in megatron's fully_reshardable
    format, the host tables and their moments by row range, all resharded by dist-checkpointing): the
    losses of the uninterrupted run at the saving layout, to 1e-4. The checkpoint is taken by that run."""
    straight = runs.shared("parallel=tp2", nodes=2, nproc=2)
    saved = f"checkpoint.load={straight.out_dir / 'checkpoints' / 'step_000004'}"
    for name, nnodes in (("one_node", 1), ("four_nodes", 4)):
        resumed = train(runs.corpus, tmp_path / name, "parallel=dp2", saved, nodes=nnodes).metrics
        assert [r["step"] for r in resumed] == list(range(5, STEPS + 1))
        for r, s in zip(resumed, straight.metrics[4:]):
            assert abs(r["loss"] - s["loss"]) < 1e-4, (name, r["step"], r["loss"], s["loss"])


LAYOUTS = {  # (overrides, nodes, ranks a node)
    "1 node x DP 2, lazy": (("parallel=dp2",), 1, 2),
    "2 nodes x DP, lazy, hot-row cache": (("parallel=dp2", "host_tables.cache_rows=16"), 2, 1),
    "4 nodes x DP, dense": (("parallel=dp2", "host_tables.optimizer=dense"), 4, 1),
    "2 nodes x PP 2, STEM after the first of 6 layers": (("parallel=pp2", "model.num_layers=6", "stem.ratio=full"),
                                                         2, 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_work_beside_the_step_changes_nothing(runs, tmp_path, layout):
    """The default run, where a layer's row gradients go to their owners from its backward hook
    (``host_tables.overlap_exchange``: while backward runs on through the earlier layers) and CPU Adam updates the rows
    any rank reads next first and the rest on a background thread while the next step runs
    (``host_tables.overlap_update``), against the serial order (both off: every exchange after backward, every row
    updated before the next step), on one node and across nodes, with lazy Adam (the hot-row cache's rows among those
    read next) and dense Adam, and with two pipeline stages of 2 micro-batches a step. Losses, grad norms, validation
    losses and every weight and table row are bitwise the same, and the work beside the step did run."""
    overrides, nnodes, nproc = LAYOUTS[layout]
    beside = runs.shared(*overrides, nodes=nnodes, nproc=nproc)
    serial = train(runs.corpus, tmp_path, *overrides, *SERIAL, nodes=nnodes, nproc=nproc)
    on, off = beside.metrics, serial.metrics
    keys = ("step", "loss", "grad_norm", "valid_loss")
    assert [[r.get(k) for k in keys] for r in on] == [[r.get(k) for k in keys] for r in off]
    assert all(r["stem_rows_updated_later"] == 0 and r["stem_layers_sent_in_backward"] == 0 for r in off)
    assert all(r["stem_rows_updated_later"] <= r["stem_node_rows_updated"] for r in on)
    assert sum(r["stem_rows_updated_later"] for r in on[:-1]) > 0
    assert sum(r["stem_cpu_adam_overlapped_s"] for r in on) > 0
    if nnodes > 1:  # each stage's STEM layers went to their owners from the last micro-batch's backward
        layers = 2 if "parallel=pp2" in overrides else 1
        assert [r["stem_layers_sent_in_backward"] for r in on] == [layers] * STEPS
    weights, serial_weights = beside.weights(), serial.weights()
    assert weights.keys() == serial_weights.keys() and any(".U_l." in name for name in weights)
    assert all(torch.equal(weights[n], serial_weights[n]) for n in serial_weights)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["lazy", "dense"])
def test_owners_working_sets_on_two_nodes_train_bitwise_like_the_host_step(runs, tmp_path, optimizer):
    """2 nodes x 2 DP peers with working sets (``host_tables.resident_rows``): each rank's set holds the rows it owns
    that the group reads, updates them with every rank's gradients and sends them back along the exchange's routes
    reversed (rail, then node). Against the host step at the same layout, with validation passes and checkpoints at
    steps 4 and 8 (both read the host copies: written back, pulled across nodes), where the lazy run stops after step 4
    and resumes (the recipe's dense Adam runs straight through): steps, losses, grad norms, validation losses and every
    exported weight bitwise equal. The collective audit of step 2: the host step's as
    test_every_rank_issues_the_step_collectives_in_one_order checks it (megatron's DP reduction after backward); with
    working sets one order on every rank, from the main thread but for the prefetch thread's plan of step 3, on groups
    no other thread uses; the rows' way back is the main thread's last two collectives, the gradients' two levels
    reversed, and no refresh of the host copies (its node barrier) remains."""
    setting = ("parallel=dp2", f"host_tables.optimizer={optimizer}", "logging.collective_audit=2")
    host = runs.shared(*setting, nodes=2, nproc=2)
    resident = (*setting, "host_tables.resident_rows=8")
    if optimizer == "lazy":
        first = train(runs.corpus, tmp_path, *resident, "train.exit_after_steps=4", nodes=2, nproc=2)
        assert [r["step"] for r in first.metrics] == [1, 2, 3, 4]
    run = train(runs.corpus, tmp_path, *resident, nodes=2, nproc=2)
    got, ref = run.metrics, host.metrics
    keys = ("step", "loss", "grad_norm", "valid_loss")
    assert [[r.get(k) for k in keys] for r in got] == [[r.get(k) for k in keys] for r in ref]
    assert sum("valid_loss" in r for r in ref) == 2
    assert sum(r["stem_rows_left"] for r in got) > 0 and sum(r["stem_node_bytes_sent"] for r in got) > 0
    if optimizer == "lazy":  # rows entered beside the step before, as planned ahead. With dense Adam only until that
        # step begins its update, which this tiny model reaches before the plan across 4 ranks comes (seen: none
        # ahead); tests/test_working_set.py slows the decay to check them
        assert sum(r["stem_rows_entered_ahead"] for r in got) > 0
    weights, host_weights = run.weights(), host.weights()
    assert weights.keys() == host_weights.keys() and any(".U_l." in name for name in weights)
    assert all(torch.equal(weights[n], host_weights[n]) for n in host_weights)
    audits = {name: json.loads((r.out_dir / "collective_audit_step2.json").read_text())
              for name, r in (("host", host), ("resident", run))}
    _assert_one_order(audits["host"], 4, overlap=False)
    assert audits["resident"]["divergence"] is None, audits["resident"]["summary"]
    assert set(audits["resident"]["threads"]) <= {"MainThread", "stem-prefetch"}, audits["resident"]["threads"]
    for every in audits["resident"]["calls"].values():  # gradients out: node, then rail; rows back, last: rail, node
        calls = [c for c in every if c["thread"] == "MainThread"]
        ahead = {c["group"] for c in every if c["thread"] == "stem-prefetch"}  # step 3 planned: groups of its own
        assert ahead.isdisjoint(c["group"] for c in calls), every
        dp = next(i for i, c in enumerate(calls) if c["op"].startswith("reduce_scatter"))
        out = [c["group"] for c in calls[:dp] if c["op"] == "all_to_all_single"]
        back = calls[-2:]
        assert len(out) == 2 and [c["op"] for c in back] == ["all_to_all_single"] * 2, calls
        assert [c["group"] for c in back] == out[::-1], calls
        assert not any(c["op"] == "barrier" for c in calls), calls  # no refresh of the host copies


@pytest.mark.slow
def test_every_rank_issues_the_step_collectives_in_one_order(runs, tmp_path):
    """DP=2 x TP=2 on one node (2 nodes x 2 DP peers: the owners test checks its host step's audit alike): the
    collective audit of a step (``logging.collective_audit``) records every collective of every rank, on gloo as
    on NCCL, with its thread and group. Every pair of ranks issues the collectives of the groups it shares in one
    order (NCCL hangs where two ranks interleave them differently), the row exchange's all-to-alls among them, and
    no collective comes from a side thread. Megatron's DP communication is overlapped too, in buckets of 5,000
    elements: each bucket's reduce-scatter goes out from backward, between the layers' row exchanges, and the
    weights' all-gathers from the step's forward, before any reduction."""
    train(runs.corpus, tmp_path, "parallel=tp2", "logging.collective_audit=2", "parallel.overlap_grad_reduce=true",
          "parallel.overlap_param_gather=true", "parallel.ddp_bucket_size=5000", nproc=4)
    _assert_one_order(json.loads((tmp_path / "collective_audit_step2.json").read_text()), 4, overlap=True)


def _assert_one_order(audit: dict, ranks: int, overlap: bool) -> None:
    """A step's audit: no divergence between ranks, all from the main thread, the rows sent to their owners, and
    megatron's DP reduction either overlapped with backward (buckets' reduce-scatters between the row exchanges,
    after the forward's all-gathers) or after it (one reduce-scatter, then the all-gathers)."""
    assert audit["divergence"] is None, audit["summary"]
    assert len(audit["calls"]) == ranks
    assert set(audit["threads"]) == {"MainThread"}, audit["threads"]
    for calls in audit["calls"].values():
        reductions = [i for i, c in enumerate(calls) if c["op"].startswith("reduce_scatter")]
        dp = calls[reductions[0]]["group"]
        gathers = [i for i, c in enumerate(calls) if c["group"] == dp and c["op"].startswith("all_gather")]
        between = {c["op"] for c in calls[reductions[0]:reductions[-1]] if not c["op"].startswith("reduce_scatter")}
        if overlap:
            assert len(reductions) > 2 and any(op.startswith("all_to_all") for op in between), calls
            assert gathers[-1] < reductions[0], calls
        else:
            assert len(reductions) == 1 and gathers[0] > reductions[0], calls
        assert sum(c["op"] in ("all_to_all_single", "alltoall_base") for c in calls) >= 2, calls  # the STEM layer's rows went to owners
