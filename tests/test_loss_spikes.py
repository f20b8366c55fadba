"""Loss spikes in the loop (training/components/loss_spikes.py): every step's record gets the detector's fields, and a
spike of finite size one line on rank 0."""

from stem_megatron.config import LoggingConfig
from stem_megatron.training.components.loss_spikes import LossSpikes


def test_a_spike_is_in_its_record_and_a_finite_one_is_said_in_one_line(world_of_one, capsys):
    spikes = LossSpikes(LoggingConfig(spike_window=5, spike_warmup=5, spike_detrend=False))
    records = []
    for step, loss in enumerate([2.0, 2.1, 1.9, 2.0, 2.1, 9.0, float("nan"), 2.0], 1):
        record = {"step": step, "loss": loss}
        record.update(spikes.check(record))
        spikes.say(record)
        records.append(record)
    assert [(r["step"], r["loss_spike_count"]) for r in records if r["loss_spike"]] == [(6, 1), (7, 2)]
    assert records[6]["loss_spike_size"] is None and records[7]["loss_spike_count"] == 2
    assert spikes.detector.count == 2  # what a checkpoint keeps
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("loss spike at step 6: 9.0000 is ")
    assert lines[0].endswith(" std above the recent losses (1 so far)")
