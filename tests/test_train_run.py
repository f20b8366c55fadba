"""The `stem-train` entry point: a short TP=2 CPU run's loss falls; a token id outside the vocabulary fails with a
clear error; a bad setting ends the run with one line naming it, not a traceback; the entry module, which spawned
children import again, is light."""

import subprocess
import sys

import distributed
import pytest
import torch
from conftest import VOCAB
from runs import STEPS

from stem_megatron.config import HostTablesConfig, ModelConfig, RunConfig, TrainConfig
from stem_megatron.model.token_context import token_ids


def test_a_short_run_learns(runs):
    """TP=2, 8 steps at the recipe's peak lr: the loss falls by more than 1 nat, the lr warms up to the peak and
    decays, and rank 0 prints a line a step. That a rerun reproduces a run bit for bit: every bitwise comparison
    of two runs (tests/test_checkpoint.py, test_multinode.py, test_preemption.py)."""
    run = runs.shared("parallel=tp2", nproc=2)
    first = run.metrics
    assert [r["step"] for r in first] == list(range(1, STEPS + 1))
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"} <= set(first[0])
    losses = [r["loss"] for r in first]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, f"loss did not fall: {losses}"
    assert max(r["lr"] for r in first) == pytest.approx(3e-3)  # recipe's peak, then decay
    assert first[-1]["lr"] < 1e-3
    assert f"step {STEPS:>6}/{STEPS}" in run.stdout  # console progress


def test_a_bad_setting_ends_the_run_with_one_line_naming_it(corpus):
    """Exit code 1 and the validation's message alone on stderr (no Hydra traceback); under the job scripts'
    torchrun (``python -m stem_megatron.torchrun``) each rank's line says which rank, the job ends with one of them
    and no traceback follows (plain torchrun's ChildFailedError)."""
    args = ["-m", "stem_megatron.train", f"model.vocab_size={VOCAB}", f"data.vocab_size={VOCAB}",
            f"data.dir={corpus}", "train.micro_batch_size=2", "train.global_batch_size=7"]
    one = subprocess.run([sys.executable, *args, "parallel=single"], capture_output=True, text=True, timeout=300)
    assert one.returncode == 1
    assert one.stderr == "error: train.global_batch_size: 7 is not divisible by micro_batch_size*dp = 2\n"
    two = subprocess.run([sys.executable, "-m", "stem_megatron.torchrun", "--nproc_per_node", "2", *args,
                          "parallel=dp2"], capture_output=True, text=True, timeout=300)
    assert two.returncode == 1
    said = {f"[rank {r}] error: train.global_batch_size: 7 is not divisible by micro_batch_size*dp = 4" for r in (0, 1)}
    lines = [line for line in two.stderr.splitlines() if "error: " in line and "train.global_batch_size" in line]
    assert lines and set(lines) <= said and lines[-1] == two.stderr.splitlines()[-1], two.stderr
    assert "Traceback" not in two.stderr, two.stderr


def test_token_id_outside_vocab_is_rejected_before_lookup():
    with pytest.raises(ValueError, match=r"token id 4096 at position \(0, 1\) is >= vocab_size 4096"):
        with token_ids(torch.tensor([[3, 4096, 5]]), 4096):
            pass
    with pytest.raises(ValueError, match="negative"):
        with token_ids(torch.tensor([[-1, 2]]), 4096):
            pass


def _step_with_bad_batch():
    from stem_megatron.training.setup import setup_model
    from stem_megatron.training.step import train_step

    cfg = RunConfig(model=ModelConfig(num_layers=2, vocab_size=64, seq_length=8),
                    host_tables=HostTablesConfig(placement="device"),
                    train=TrainConfig(micro_batch_size=1, global_batch_size=1))
    trainer = setup_model(cfg)
    tokens = torch.tensor([[1, 2, 64, 3, 4, 5, 6, 7]])
    try:
        train_step(trainer, iter([{"tokens": tokens, "labels": tokens}]), 1, 1, 8, 64)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.slow
def test_bad_token_in_training_batch_raises_clear_error():
    message = distributed.run(_step_with_bad_batch, 1)[0]
    assert message is not None and "token id 64" in message and "vocab_size 64" in message


def test_the_entry_module_imports_nothing_heavy():
    """A process the training process spawns imports its ``__main__`` again (``stem_megatron.train``), as megatron's
    checkpoint writer does on each rank's first save: that module alone loads neither torch nor megatron-core."""
    probe = "import sys, stem_megatron.train; print(sorted({'torch', 'megatron', 'hydra'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
