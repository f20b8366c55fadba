"""Communication overlapped with backward vs after it, side by side: the STEM row exchange
(``--what exchange``: ``host_tables.overlap_exchange``) or megatron DDP's bucket reductions and weight all-gathers
(``--what dp``: ``parallel.overlap_grad_reduce`` and ``overlap_param_gather``, buckets of ``--bucket`` elements).

Two torchrun agents on this host are two nodes (DP=2 across them, one process each): the tiny model,
STEM-1/3, 2 micro-batches per rank and step, trained on documents whose token ids are drawn from a real
128k-vocabulary profile (benchmarks/data/token_counts_128k.npy, unigram draws; the demo's 4096-token
vocabulary would hide the exchange's cost, which grows with distinct ids). Runs alternate off / on for
``--rounds``; per setting the median over the runs' steps (the first ``--skip`` left out) of the step
time, the time the step waited for the exchange (``stem_exchange_wait_s``) and the time the exchange
itself took (``stem_exchange_s``, inside backward when overlapped), and whether both settings
produced the same losses bit for bit.

Run: ``.venv/bin/python benchmarks/exchange_overlap.py [--what dp] [--rounds 2] [--steps 15] [--json out.json]``
(about 6 minutes here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's stem_megatron, installed or not
from stem_megatron.setup_check import require_environment  # noqa: E402

require_environment()  # before torch and megatron: another Python gets `make setup`, not a traceback

import numpy as np  # noqa: E402
from tokenizers import Tokenizer, models  # noqa: E402
from torch.distributed.elastic.utils.distributed import get_free_port  # noqa: E402

from stem_megatron.data.tokenizer import EOD_TOKEN  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from row_sync import DEFAULT_COUNTS, load_counts  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def write_corpus(out: Path, counts: np.ndarray, tokens: int, doc_tokens: int = 512, seed: int = 0) -> int:
    """A word-level tokenizer over the profile's ids (id 0 is the EOD token) and train/valid datasets of
    documents drawn from it; returns the vocabulary size."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # after stem_megatron: quiet

    vocab = len(counts)
    out.mkdir(parents=True, exist_ok=True)
    words = {EOD_TOKEN: 0, **{f"t{i}": i for i in range(1, vocab)}}
    Tokenizer(models.WordLevel(words, unk_token=EOD_TOKEN)).save(str(out / "tokenizer.json"))
    p = counts[1:].astype(np.float64) / counts[1:].sum()
    rng = np.random.default_rng(seed)
    for prefix, n in (("train", tokens), ("valid", 4 * doc_tokens)):
        builder = IndexedDatasetBuilder(str(out / f"{prefix}.bin"), dtype=DType.optimal_dtype(vocab))
        for _ in range(n // doc_tokens):
            ids = np.append(rng.choice(vocab - 1, size=doc_tokens - 1, p=p) + 1, 0)
            builder.add_document(ids, [len(ids)])
        builder.finalize(str(out / f"{prefix}.idx"))
    return vocab


def overlap_settings(what: str, overlap: bool, bucket: int) -> list[str]:
    on = str(overlap).lower()
    if what == "exchange":
        return [f"host_tables.overlap_exchange={on}"]
    return [f"parallel.overlap_grad_reduce={on}", f"parallel.overlap_param_gather={on}",
            f"parallel.ddp_bucket_size={bucket}"]


def train(out_dir: Path, corpus: Path, vocab: int, steps: int, settings: list[str]) -> list[dict]:
    """One run on two torchrun agents (two nodes); its metrics.jsonl records."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{get_free_port()}", "--rdzv_id=overlap",
           "-m", "stem_megatron.train", "parallel=dp2", f"model.vocab_size={vocab}", f"data.vocab_size={vocab}",
           f"data.dir={corpus}", f"train.steps={steps}", "train.micro_batch_size=4", "train.global_batch_size=16",
           "train.eval_iters=0", "checkpoint.resume=false", "checkpoint.save_interval=0", f"out_dir={out_dir}",
           *settings]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
              for _ in range(2)]
    for agent in agents:
        out, _ = agent.communicate()
        if agent.returncode != 0:
            raise SystemExit(f"exchange_overlap.py: the training run failed (exit {agent.returncode}):\n{out[-3000:]}")
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--what", choices=("exchange", "dp"), default="exchange")
    ap.add_argument("--bucket", type=int, default=2_000_000, help="--what dp: elements per DDP bucket")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--skip", type=int, default=3, help="first steps of each run left out (start-up)")
    ap.add_argument("--counts", type=Path, default=DEFAULT_COUNTS)
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench_overlap")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    counts = load_counts(args.counts)
    tokens = args.steps * 16 * 128 + 64 * 512  # every step's samples, with room for megatron's packing
    corpus = args.out / "corpus"
    vocab = write_corpus(corpus, counts, tokens)
    runs = {False: [], True: []}
    for r in range(args.rounds):
        for overlap in (False, True):
            runs[overlap].append(train(args.out / args.what / f"run{r}_{overlap}", corpus, vocab, args.steps,
                                       overlap_settings(args.what, overlap, args.bucket)))
    result = {}
    for overlap, records in runs.items():
        steps = [s for run in records for s in run[args.skip:]]
        result["on" if overlap else "off"] = {
            key: statistics.median(s[key] for s in steps)
            for key in ("step_time_s", "stem_exchange_wait_s", "stem_exchange_s", "stem_layers_sent_in_backward",
                        "stem_node_bytes_sent")}
    same = all([s["loss"] for s in a] == [s["loss"] for s in b] for a, b in zip(runs[False], runs[True]))
    result.update(what=args.what, vocab=vocab, rounds=args.rounds, steps=args.steps, losses_identical=same,
                  step_time_ratio=result["on"]["step_time_s"] / result["off"]["step_time_s"])
    overlapped = ("the row exchange" if args.what == "exchange"
                  else f"DDP's reductions and weight all-gathers, buckets of {args.bucket:,} elements")
    print(f"2 nodes x DP, tiny STEM-1/3, V={vocab:,} (ids from {args.counts.name}), 2 micro-batches a rank, "
          f"{args.rounds} runs x {args.steps - args.skip} steps per setting (medians); overlapped: {overlapped}")
    print(f"{'overlap':>8} {'step (s)':>9} {'waited (s)':>11} {'in exchange (s)':>16} {'layers sent in backward':>24} "
          f"{'MB sent per node':>17}")
    for name in ("off", "on"):
        m = result[name]
        print(f"{name:>8} {m['step_time_s']:>9.3f} {m['stem_exchange_wait_s']:>11.4f} {m['stem_exchange_s']:>16.4f} "
              f"{m['stem_layers_sent_in_backward']:>24.0f} {m['stem_node_bytes_sent'] / 1e6:>17.2f}")
    off_ms, on_ms = (result[name]["stem_exchange_wait_s"] * 1e3 for name in ("off", "on"))
    print(f"step time on/off: {result['step_time_ratio']:.3f}; the step's wait for the exchange: {off_ms:.1f} ms -> "
          f"{on_ms:.1f} ms; losses identical: {'yes' if same else 'NO'}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
