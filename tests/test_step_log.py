"""The steps a run keeps (training/components/step_log.py): every train.log_interval steps, the last, and a step with
a spike, a validation or a stop, written to metrics.jsonl with a console line and given to W&B alike."""

import json
import signal

from stem_megatron.config import RunConfig
from stem_megatron.training.components.step_log import StepLog
from stem_megatron.training.preemption import Decision


class Tracker:
    """Stands in for the W&B run: what it was given, and how it ended."""

    def __init__(self):
        self.logged, self.ended = [], None

    def log(self, record):
        self.logged.append(record)

    def __exit__(self, *exc):
        self.ended = exc


def test_the_steps_kept_are_the_interval_s_the_last_and_those_a_reader_looks_for(world_of_one, tmp_path, capsys):
    cfg = RunConfig(out_dir=str(tmp_path))
    cfg.train.steps, cfg.train.log_interval = 8, 3
    tracker = Tracker()
    with StepLog(cfg, resumed=0) as step_log:
        step_log.tracker = tracker
        for step in range(1, 9):
            record = {"step": step, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0,
                      "loss_spike": step == 2}
            if step == 4:
                record |= {"valid_loss": 2.5, "valid_ppl": 12.2}
            step_log.log(record, Decision(stop=signal.SIGTERM) if step == 5 else Decision(save_due=step == 7))
    kept = [2, 3, 4, 5, 6, 8]  # a spike, the interval, a validation, a stop, the interval, the last
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in written] == kept and tracker.logged == written
    assert tracker.ended == (None, None, None) and step_log.writer._file.closed
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == [f"{step}/8" for step in kept]
    assert lines[2].endswith("valid_loss 2.5000  valid_ppl 12.2")
