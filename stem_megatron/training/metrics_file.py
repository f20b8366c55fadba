"""Per-step metrics: one JSON object per line in ``<run>/metrics.jsonl`` and a console line (rank 0)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from stem_megatron.training.run_summary import eta_text


class MetricsWriter:
    """Appends step records; only the writing rank creates it (others pass ``enabled=False``)."""

    def __init__(self, run_dir: str | Path, enabled: bool, total_steps: int, resume_step: int = 0):
        """``resume_step`` > 0: a resumed run drops the records an earlier attempt wrote after its last
        checkpoint (they are about to be recomputed) and keeps the rest. A run starting at step 1 in a
        directory that has metrics moves them to ``metrics.<n>.jsonl`` rather than mixing two runs."""
        self.enabled = enabled
        self.total_steps = total_steps
        self._file = None
        if enabled:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            path = Path(run_dir) / "metrics.jsonl"
            if resume_step and path.exists():
                kept = [line for line in path.read_text().splitlines()
                        if line.strip() and json.loads(line)["step"] <= resume_step]
                path.write_text("".join(line + "\n" for line in kept))
            elif path.exists() and path.stat().st_size:
                n = 1
                while (aside := path.with_name(f"metrics.{n}.jsonl")).exists():
                    n += 1
                path.rename(aside)
            self._file = open(path, "a", buffering=1)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        gn, mfu = record.get("grad_norm"), record.get("mfu")
        print(
            f"step {record['step']:>6}/{self.total_steps}  loss {record['loss']:.4f}  "
            f"lr {record['lr']:.2e}  grad_norm {gn if gn is None else f'{gn:.3f}'}  "
            f"tokens/s {record['tokens_per_s']:.0f}"
            + (f"  mfu {100 * mfu:.1f}%" if mfu is not None else "")
            + (f"  mem {record['memory_gib']:.1f} GiB  eta {eta_text(record['eta_s'])}" if "eta_s" in record else "")
            + (f"  valid_loss {record['valid_loss']:.4f}  valid_ppl {record['valid_ppl']:.1f}"
               if "valid_loss" in record else ""),
            flush=True,
        )
        if not math.isfinite(record["loss"]):
            print(f"warning: non-finite loss at step {record['step']}", flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
