"""``benchmarks/dataset_index.py`` (docs/benchmarks.md) at its smallest: megatron's index build on synthetic corpora
with sparse ``.bin`` files, in forked processes (this module starts no process group, which they would inherit)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import dataset_index  # noqa: E402


def test_dataset_index_benchmark_at_its_smallest(capsys):
    """1M and 2M tokens, and 2M in 3 parts: megatron reads no byte of any ``.bin``, its indices grow with the tokens,
    each part builds its own, and the table and the 1T projections print."""
    rows = dataset_index.main(["--sizes", "0.001", "0.002", "--parts", "3", "--parts-of", "0.002",
                               "--seq-length", "64"])
    assert [(r["tokens"], r["parts"], r["samples"]) for r in rows] == [
        (n, parts, (n - 1) // 64) for n, parts in ((10 ** 6, 1), (2 * 10 ** 6, 1), (2 * 10 ** 6, 3))]
    assert [r["bin_kib"] for r in rows] == [0, 0, 0]
    assert rows[0]["index_mib"] < rows[1]["index_mib"] < rows[2]["index_mib"]
    assert {"document_s", "sample_s", "shuffle_s"} <= set(rows[0]) and "blend_s" in rows[2]
    out = capsys.readouterr().out
    assert "projected to 1T tokens in one prefix from 0.002B" in out and "blend index of 3 parts at 1T tokens" in out
