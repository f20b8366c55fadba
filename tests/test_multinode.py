"""Several torchrun agents on this host are separate nodes (each its own host copy of the STEM tables,
the node from the launcher, not from rank order): a run on 2 nodes trains exactly as the same layout
on one node (losses, grad norms, every weight and table row of the export)."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import VOCAB

STEPS = 6


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cmd(corpus, out_dir, parallel, nnodes, nproc):
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={nproc}",
            "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{_port()}", "--rdzv_id=stem-test",
            "-m", "stem_megatron.train", f"parallel={parallel}", "variant=stem_1_3", "model.num_layers=3",
            "model.seq_length=32", f"model.vocab_size={VOCAB}", f"data.vocab_size={VOCAB}", f"data.dir={corpus}",
            f"out_dir={out_dir}", f"train.steps={STEPS}", "train.micro_batch_size=2", "train.global_batch_size=4",
            f"checkpoint.export={out_dir}/export"]


def _run(corpus, out_dir, parallel, nnodes, nproc):
    """One torchrun agent per node, all on this host, joined through one c10d rendezvous."""
    cmd = _cmd(corpus, out_dir, parallel, nnodes, nproc)
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(nnodes)]
    outputs = [agent.communicate(timeout=900) for agent in agents]
    for agent, (out, err) in zip(agents, outputs):
        assert agent.returncode == 0, out[-2000:] + err[-4000:]
    metrics = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    weights = torch.load(Path(out_dir) / "export" / "model.pt", weights_only=True)["weights"]
    return metrics, weights


@pytest.mark.slow
@pytest.mark.parametrize("parallel,nproc", [("dp2", 1), ("tp2", 2)])
def test_two_nodes_train_as_one(corpus, tmp_path, parallel, nproc):
    """2 nodes x DP (one rank each) and 2 nodes x TP=2 (DP=2 across the nodes) against the same world on
    one node: bitwise equal losses, grad norms, dense weights and STEM table rows."""
    world = 2 * nproc
    one_metrics, one_weights = _run(corpus, tmp_path / "one", parallel, 1, world)
    two_metrics, two_weights = _run(corpus, tmp_path / "two", parallel, 2, nproc)
    assert [r["loss"] for r in two_metrics] == [r["loss"] for r in one_metrics]
    assert [r["grad_norm"] for r in two_metrics] == [r["grad_norm"] for r in one_metrics]
    assert two_weights.keys() == one_weights.keys()
    assert any(".U_l." in name for name in two_weights)
    assert all(torch.equal(two_weights[n], one_weights[n]) for n in one_weights)
