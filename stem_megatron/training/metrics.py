"""Per-step metrics: one JSON object per line in ``<run>/metrics.jsonl`` and a console line (rank 0)."""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsWriter:
    """Appends step records; only the writing rank creates it (others pass ``enabled=False``)."""

    def __init__(self, run_dir: str | Path, enabled: bool, total_steps: int):
        self.enabled = enabled
        self.total_steps = total_steps
        self._file = None
        if enabled:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            self._file = open(Path(run_dir) / "metrics.jsonl", "a", buffering=1)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        gn = record.get("grad_norm")
        print(
            f"step {record['step']:>6}/{self.total_steps}  loss {record['loss']:.4f}  "
            f"lr {record['lr']:.2e}  grad_norm {gn if gn is None else f'{gn:.3f}'}  "
            f"tokens/s {record['tokens_per_s']:.0f}",
            flush=True,
        )
        if not math.isfinite(record["loss"]):
            print(f"warning: non-finite loss at step {record['step']}", flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
