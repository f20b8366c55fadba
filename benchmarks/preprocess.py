"""stem-preprocess against the tokenizer's own ``encode_batch``, side by side on the same documents.

The documents are the Python 3.11 documentation sources (the demo corpus's text) cut into ~3 KB documents (DCLM's
median is a few KB), written as one ``.jsonl`` (and ``.jsonl.zst`` with ``--zst``). Per round, alternating: the
tokenizer's ``encode_batch`` on every core over the documents already in memory (the ceiling: no reading, no
parsing, no writing), then ``preprocess`` with each ``--workers`` count (file to ``.bin``/``.idx``, in this process,
imports excluded). It prints, as medians over ``--rounds``, tokens per wall second and per CPU second (this process's
threads and its ended worker processes: steadier than wall time on a loaded machine, and what a cluster's core-hours
cost), each against ``encode_batch``, the workers' scaling, and the hours 1T tokens take on ``--cluster-cores``
cores at the slowest rate per CPU second.

Run: ``.venv/bin/python benchmarks/preprocess.py [--tokenizer data_cache/python-doc/tokenizer.json] [--rounds 3]
[--workers 1 2] [--zst] [--max-mb 12]`` (about two minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's stem_megatron, installed or not
from stem_megatron.setup_check import DEMO_CORPUS, require_environment, require_extra  # noqa: E402

require_environment()  # before torch and megatron: another Python gets `make setup`, not a traceback

from tokenizers import Tokenizer  # noqa: E402

from stem_megatron.data.corpus import DEFAULT_SOURCE_DIR  # noqa: E402
from stem_megatron.data.preprocess import preprocess  # noqa: E402

DOC_BYTES = 3000


def documents(source_dir: str, max_bytes: int) -> list[str]:
    """The sources' paragraphs gathered into documents of about ``DOC_BYTES``, up to ``max_bytes`` in all."""
    docs, size = [], 0
    for path in sorted(Path(source_dir).rglob("*.txt")):
        current = ""
        for paragraph in path.read_text(encoding="utf-8").split("\n\n"):
            current += paragraph + "\n\n"
            if len(current) >= DOC_BYTES:
                docs.append(current)
                size, current = size + len(current), ""
        if current:
            docs.append(current)
            size += len(current)
        if size >= max_bytes:
            break
    return docs


def _cpu_seconds() -> float:
    """CPU time of this process (all its threads) and its ended children (the workers, once their pool is shut)."""
    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def timed(run) -> tuple[float, float]:
    """``run()``'s tokens per wall second and per CPU second (on a loaded machine the second is the steadier)."""
    wall, cpu = time.perf_counter(), _cpu_seconds()
    tokens = run()
    return tokens / (time.perf_counter() - wall), tokens / (_cpu_seconds() - cpu)


def encode_batch_rate(tokenizer_path: str, docs: list[str]) -> tuple[float, float]:
    """Tokens/s of ``encode_batch`` over ``docs`` on every core (the tokenizer's own thread pool)."""
    os.environ.pop("TOKENIZERS_PARALLELISM", None)
    tokenizer = Tokenizer.from_file(tokenizer_path)
    return timed(lambda: sum(len(e.ids) for e in tokenizer.encode_batch(docs)))


def tool_rate(inputs: Path, tokenizer_path: str, workers: int, out: Path) -> tuple[float, float]:
    """Tokens/s of ``preprocess`` from ``inputs`` to a fresh ``.bin``/``.idx``, end to end."""
    prefix = out / f"w{workers}-{time.monotonic_ns()}" / "train"
    return timed(lambda: preprocess([inputs], prefix, tokenizer_path, workers=workers)["tokens"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=str(DEMO_CORPUS / "tokenizer.json"))
    parser.add_argument("--source-dir", default=DEFAULT_SOURCE_DIR)
    parser.add_argument("--max-mb", type=float, default=12.0, help="input size")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, len(os.sched_getaffinity(0))])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--zst", action="store_true", help="also from .jsonl.zst (decompression in the reader)")
    parser.add_argument("--cluster-cores", type=int, default=16 * 64, help="for the 1T-token projection (16 nodes of 64 cores)")
    args = parser.parse_args(argv)
    docs = documents(args.source_dir, int(args.max_mb * 1e6))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        inputs = {"jsonl": tmp / "docs.jsonl"}
        inputs["jsonl"].write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
        if args.zst:
            require_extra("data")
            import zstandard

            inputs["jsonl.zst"] = tmp / "docs.jsonl.zst"
            inputs["jsonl.zst"].write_bytes(zstandard.ZstdCompressor().compress(inputs["jsonl"].read_bytes()))
        print(f"{len(docs):,} documents, {inputs['jsonl'].stat().st_size / 1e6:.1f} MB of jsonl, tokenizer "
              f"{args.tokenizer}, {len(os.sched_getaffinity(0))} cores, {args.rounds} rounds", flush=True)
        rates: dict[str, list[tuple[float, float]]] = {}
        for round_ in range(args.rounds):
            rates.setdefault("encode_batch, all cores", []).append(encode_batch_rate(args.tokenizer, docs))
            for fmt, path in inputs.items():
                for workers in args.workers:
                    rate = tool_rate(path, args.tokenizer, workers, tmp / "out")
                    rates.setdefault(f"stem-preprocess {fmt} --workers {workers}", []).append(rate)
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    median = {name: statistics.median(wall for wall, _ in values) for name, values in rates.items()}
    per_cpu = {name: statistics.median(cpu for _, cpu in values) for name, values in rates.items()}
    ceiling, cpu_ceiling = median["encode_batch, all cores"], per_cpu["encode_batch, all cores"]
    print(f"\n{'':<40} {'M tokens/s':>10} {'x encode_batch':>15} {'M tokens/CPU-s':>15} {'x encode_batch':>15}")
    for name, rate in median.items():
        print(f"{name:<40} {rate / 1e6:>10.2f} {rate / ceiling:>15.2f} {per_cpu[name] / 1e6:>15.2f} "
              f"{per_cpu[name] / cpu_ceiling:>15.2f}")
    one = median.get("stem-preprocess jsonl --workers 1")
    if one:
        for workers in args.workers[1:]:
            scaled = median[f"stem-preprocess jsonl --workers {workers}"] / one
            print(f"scaling --workers {workers} / --workers 1: {scaled:.2f} (ideal {workers})")
    per_core = min(rate for name, rate in per_cpu.items() if name.startswith("stem-preprocess"))
    hours = 1e12 / (per_core * args.cluster_cores) / 3600
    print(f"1T tokens at {per_core / 1e6:.2f}M tokens per CPU-second (the slowest way above) on "
          f"{args.cluster_cores:,} cores: {hours:.1f} hours ({hours / 24:.2f} days)")


if __name__ == "__main__":
    main()
