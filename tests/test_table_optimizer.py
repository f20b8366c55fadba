"""The host tables as a member of megatron's ``ChainedOptimizer`` (training/table_optimizer.py): a step megatron skips
leaves the tables as they were and releases the next step, on either tier, instead of leaving the prefetch thread
waiting for a release that never comes (steps not finite: tests/test_nonfinite_steps.py); the chain asks the dense
optimizer its norm once a step.
(Their clip: tests/test_stem_clip.py; their updates against device tables: tests/test_host_store.py.)"""

import math

import distributed
import pytest
import torch

from stem_megatron.config import HostTablesConfig, ModelConfig, RunConfig, STEMConfig, TrainConfig

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=64,
                    seq_length=16)
MICRO = 2


def _skipped_step(resident_rows):
    from megatron.core.optimizer import ChainedOptimizer
    from stem_megatron.training.setup import setup_model
    from stem_megatron.training.step import train_step

    cfg = RunConfig(model=MODEL, stem=STEMConfig(variant="stem", ratio="1/2"),
                    host_tables=HostTablesConfig(optimizer="lazy", resident_rows=resident_rows),
                    train=TrainConfig(steps=3, micro_batch_size=MICRO, global_batch_size=MICRO, warmup_ratio=0.0))
    trainer = setup_model(cfg)
    assert isinstance(trainer.optimizer, ChainedOptimizer)
    trainer.optimizer.config.grad_norm_skip_threshold = 0.0  # every step's norm is above it: megatron skips
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, MODEL.vocab_size, (MICRO, MODEL.seq_length + 1), generator=g) for _ in range(3)]
    store = trainer.tables
    with store.stream(iter([{"tokens": s[:, :-1], "labels": s[:, 1:]} for s in seqs]), 1) as data:
        store.settle()
        before = {layer: store.table(layer) for layer in store.layers}
        dense = [p.detach().clone() for p in trainer.model.parameters()]
        record = train_step(trainer, data, 1, MICRO, MODEL.seq_length, MODEL.vocab_size)
        store.settle()
        after = {layer: store.table(layer) for layer in store.layers}
        dense_after = [p.detach().clone() for p in trainer.model.parameters()]
        next_record = train_step(trainer, data, 1, MICRO, MODEL.seq_length, MODEL.vocab_size)
    return {"skipped": (record["update_skipped"], next_record["update_skipped"]),
            "norms": (record["grad_norm"], record["stem_grad_norm"]),
            "tables_kept": all(torch.equal(before[k], after[k]) for k in before),
            "dense_kept": all(torch.equal(a, b) for a, b in zip(dense, dense_after)),
            "steps_done": store.pipeline.steps_done}


@pytest.mark.parametrize("resident_rows", [0, MODEL.vocab_size], ids=["host-tier", "device-tier"])
def test_a_skipped_update_keeps_the_tables_and_the_next_step_goes_on(resident_rows):
    out = distributed.run(_skipped_step, 1, resident_rows)[0]
    assert out["skipped"] == (True, True), "grad_norm_skip_threshold=0 should make megatron skip every update"
    assert out["norms"][0] > 0 and out["norms"][1] > 0
    assert out["tables_kept"] and out["dense_kept"], "a skipped step changed the weights"
    assert out["steps_done"] == 0


def _norms_of_a_step():
    """Per ``host_tables.clip``: how often one chained step asked the dense optimizer its norm, the chain's norm and
    the step record's norms."""
    from stem_megatron.training.setup import setup_model
    from stem_megatron.training.step import train_step

    out = {}
    for clip in ("global", "separate"):
        cfg = RunConfig(model=MODEL, stem=STEMConfig(variant="stem", ratio="1/2"),
                        host_tables=HostTablesConfig(optimizer="lazy", clip=clip),
                        train=TrainConfig(steps=1, micro_batch_size=MICRO, global_batch_size=MICRO))
        trainer = setup_model(cfg)
        dense, chain, asked, returned = trainer.optimizer.dense, trainer.optimizer, [], []
        dense_norm, chain_step = dense.get_grad_norm, chain.step

        def counted():
            asked.append(1)
            return dense_norm()

        def step():
            returned.append(chain_step())
            return returned[-1]

        dense.get_grad_norm, chain.step = counted, step
        seq = torch.randint(0, MODEL.vocab_size, (MICRO, MODEL.seq_length + 1),
                            generator=torch.Generator().manual_seed(3))
        with trainer.tables.stream(iter([{"tokens": seq[:, :-1], "labels": seq[:, 1:]}]), 1) as data:
            record = train_step(trainer, data, 1, MICRO, MODEL.seq_length, MODEL.vocab_size)
        out[clip] = {"asked": len(asked), "chain": float(returned[0][1]),
                     "record": tuple(record[k] for k in ("grad_norm", "dense_grad_norm", "stem_grad_norm"))}
    return out


def test_the_chain_asks_the_dense_norm_once_a_step():
    out = distributed.run(_norms_of_a_step, 1)[0]
    for clip, case in out.items():
        assert case["asked"] == 1, f"{clip}: the dense optimizer's norm was computed {case['asked']} times in a step"
        joint, dense, stem = case["record"]
        assert dense > 0 and stem > 0
        assert joint == math.sqrt(dense**2 + stem**2)
    assert out["global"]["chain"] == out["global"]["record"][0], "global: the chain clips by the joint norm"
    assert out["separate"]["chain"] == out["separate"]["record"][1], "separate: the chain clips by the dense norm"


def _step_count_and_streams():
    """Two training streams of one step each (a third opened inside the first), then a checkpoint's step count loaded
    through the chain's tables member."""
    from stem_megatron.training.setup import setup_model
    from stem_megatron.training.step import train_step

    cfg = RunConfig(model=MODEL, stem=STEMConfig(variant="stem", ratio="1/2"),
                    train=TrainConfig(steps=2, micro_batch_size=MICRO, global_batch_size=MICRO))
    trainer = setup_model(cfg)
    member, g = trainer.optimizer.tables, torch.Generator().manual_seed(5)
    seq = torch.randint(0, MODEL.vocab_size, (MICRO, MODEL.seq_length + 1), generator=g)
    batches = lambda: iter([{"tokens": seq[:, :-1], "labels": seq[:, 1:]}])  # noqa: E731
    counts, refused = [], None
    for stream in range(2):
        with trainer.tables.stream(batches(), 1) as data:
            if stream == 0:
                with pytest.raises(RuntimeError) as opened:
                    trainer.tables.stream(batches(), 1)
                refused = str(opened.value)
            train_step(trainer, data, 1, MICRO, MODEL.seq_length, MODEL.vocab_size)
        counts.append(member.state_dict())
    member.load_state_dict({"steps_done": 7})
    return {"counts": counts, "refused": refused, "loaded": member.state_dict(),
            "dense_is_a_member": trainer.optimizer.dense is trainer.optimizer.chained_optimizers[0]}


def test_the_tables_member_counts_the_steps_and_one_training_stream_is_open_at_a_time():
    """The step count is the training pipeline's (the chain's member reads and loads it) and runs on across streams;
    a second training stream while one is open is refused in one line, not a second prefetch thread."""
    out = distributed.run(_step_count_and_streams, 1)[0]
    assert out["counts"] == [{"steps_done": 1}, {"steps_done": 2}]
    assert out["loaded"] == {"steps_done": 7}
    assert out["refused"] == ("the host tables' training stream is open already: leave its with-block before opening "
                              "another (HostTableStore.stream)")
    assert out["dense_is_a_member"]


def _without_host_tables(directory):
    from stem_megatron.checkpoint import host_tables
    from stem_megatron.training.setup import setup_model

    cfg = RunConfig(model=MODEL, stem=STEMConfig(variant="stem", ratio="1/2"),
                    host_tables=HostTablesConfig(placement="device"),
                    train=TrainConfig(steps=1, micro_batch_size=MICRO, global_batch_size=MICRO))
    trainer = setup_model(cfg)
    chain, batches = trainer.optimizer, [{"tokens": torch.zeros(MICRO, MODEL.seq_length, dtype=torch.long)}]
    with trainer.tables.stream(iter(batches), 1) as data:
        streamed = list(data)
    sharded = host_tables.state(chain.tables)
    host_tables.save(chain.tables, sharded, directory / "stem")
    host_tables.load(chain.tables, directory / "stem")  # nothing to read: no stem/ there
    with pytest.raises(ValueError) as refused:
        trainer.tables.load_tables({2: torch.zeros(MODEL.vocab_size, MODEL.ffn_hidden_size)})
    return {"streamed": streamed is not batches and streamed == batches, "sharded": sharded,
            "stem_dir": (directory / "stem").exists(), "stats": trainer.tables.take_stats(data),
            "refused": str(refused.value), "members": len(chain.chained_optimizers),
            "row_source": trainer.tables.row_source(), "layers": tuple(trainer.tables.layers)}


def test_without_host_tables_the_tables_are_their_absence(tmp_path):
    """``host_tables.placement=device``: the trainer's tables and the chain's tables member are their absence, whose
    verbs do what having none means (batches as they are, no counters, no ``stem/`` in a checkpoint, nothing to load);
    tables given to it are refused in one line."""
    out = distributed.run(_without_host_tables, 1, tmp_path)[0]
    assert out["streamed"] and out["sharded"] == {} and not out["stem_dir"] and out["stats"] == {}
    assert out["members"] == 1 and out["row_source"] is None and out["layers"] == ()
    assert out["refused"] == "layers [2] have no host table: their tables are the model's parameters"
