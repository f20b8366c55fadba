"""megatron's dataset index build at the paper's scale: the time and peak memory of the document, sample and
shuffle indices ``GPTDataset`` builds (``BlendedMegatronDatasetBuilder`` with ``data/datasets.py``'s config, one
epoch of ``seq_length`` samples), for synthetic corpora of 0.1B, 1B and 10B tokens and for 1B tokens as 300 parts
blended by a ``data.blend`` directory entry; projected to 1T tokens. About a minute on 2 cores.

The corpora cost little to make: document lengths drawn like DCLM's (lognormal, median 600 tokens) go into a real
``.idx`` (megatron's ``_IndexWriter``), the ``.bin`` is a sparse file of the right size. The index build reads only
the ``.idx``: each build reports how much of the ``.bin`` mapping became resident (0 kB: none was read). Each build
runs in a forked process whose peak RSS is reset to its resident memory first (``/proc/self/clear_refs``), so "peak
RSS" is the build's own (``VmHWM``: the process with megatron imported, plus the build; ``getrusage`` would also
count the parent's peak) and "+RSS" its growth. The build's steps are timed again apart (least CPU time of 3),
called as megatron calls them; the second table is CPU seconds (the machine is shared: wall times vary with its
load). Files go to a temporary directory under /tmp, removed at the end.

    python benchmarks/dataset_index.py [--sizes 0.1 1 10] [--parts 300] [--parts-of 1] [--seq-length 2048]
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's stem_megatron, installed or not
from stem_megatron.setup_check import require_environment  # noqa: E402

require_environment()  # before numpy and megatron: another Python gets `make setup`, not a traceback

import numpy as np  # noqa: E402
from megatron.core.datasets.indexed_dataset import _IndexWriter  # noqa: E402

MEDIAN_TOKENS, SIGMA = 600, 1.0  # DCLM-like document lengths: lognormal, mean ~990 tokens
SEED = 1234


def document_lengths(tokens: int, rng: np.random.Generator) -> np.ndarray:
    """int32 document lengths summing to ``tokens`` (the last one cut to fit)."""
    mean = MEDIAN_TOKENS * np.exp(SIGMA ** 2 / 2)
    lengths = np.clip(rng.lognormal(np.log(MEDIAN_TOKENS), SIGMA, int(tokens / mean * 1.1) + 10), 1, 2 ** 20)
    lengths = lengths.astype(np.int64)
    n = int(np.searchsorted(np.cumsum(lengths), tokens)) + 1
    lengths = lengths[:n]
    lengths[-1] -= lengths.sum() - tokens
    assert lengths.sum() == tokens and lengths[-1] > 0, "draw more documents"
    return lengths.astype(np.int32)


def write_dataset(prefix: Path, lengths: np.ndarray) -> None:
    """A megatron indexed dataset of ``lengths`` uint16 documents: the real ``.idx``, a sparse ``.bin``."""
    with _IndexWriter(f"{prefix}.idx", np.uint16) as writer:
        writer.write(lengths, None, np.arange(len(lengths) + 1, dtype=np.int64))
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(int(lengths.sum(dtype=np.int64)) * np.dtype(np.uint16).itemsize)


def _status_mib(key: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of this process, MiB."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(key + ":"))
    return int(line.split()[1]) / 1024


def _reset_peak_mib() -> float:
    """Resident MiB now, after resetting the peak to it (``VmHWM`` counts from here)."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mib("VmRSS")


def _bin_resident_kib() -> int:
    """Resident kB of this process's ``.bin`` mappings (megatron maps each ``.bin`` whole)."""
    resident, in_bin = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            in_bin = fields[-1].endswith(".bin")
        elif in_bin and fields[0] == "Rss:":
            resident += int(fields[1])
    return resident


def build(blend_entry: str, data_dir: str, tokenizer: str, samples: int, seq_length: int, cache: str) -> dict:
    """In a process of its own: megatron builds the indices of ``samples`` train samples, then loads them from the cache
    (what every other rank does)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    from stem_megatron.data.blend import expand_blend
    from stem_megatron.data.datasets import dataset_config
    from stem_megatron.data.tokenizer import HFTokenizer

    tok = HFTokenizer(tokenizer)
    start = time.process_time()
    blend = expand_blend([[1, blend_entry]], data_dir)
    expand_s = time.process_time() - start
    baseline = _reset_peak_mib()
    start = time.process_time()
    config = dataset_config(tok, blend, [], seq_length, SEED, cache)  # the cache digest reads every .idx whole
    digest_s = time.process_time() - start
    start, cpu = time.perf_counter(), time.process_time()
    train = BlendedMegatronDatasetBuilder(GPTDataset, [samples, None, None], lambda: True, config).build()[0]
    build_s, build_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    peak, bin_kib = _status_mib("VmHWM"), _bin_resident_kib()
    start = time.perf_counter()
    again = BlendedMegatronDatasetBuilder(GPTDataset, [samples, None, None], lambda: True, config).build()[0]
    load_s = time.perf_counter() - start
    assert len(train) == len(again) >= samples
    index_mib = sum(f.stat().st_size for f in Path(cache).rglob("*.npy")) / 2 ** 20
    steps = (_steps(train.dataset.sequence_lengths, samples, seq_length) if len(blend) == 1
             else {"blend_s": _fastest(_blending_indices, train.weights, samples)[1]})
    return {**steps, "expand_s": expand_s, "digest_s": digest_s, "build_s": build_s, "build_cpu_s": build_cpu_s,
            "load_s": load_s, "peak_mib": peak, "grow_mib": peak - baseline, "index_mib": index_mib, "bin_kib": bin_kib}


def _fastest(step, *args):
    """``step(*args)`` and its least CPU time of 3 (the machine is shared)."""
    times = []
    for _ in range(3):
        start = time.process_time()
        out = step(*args)
        times.append(time.process_time() - start)
    return out, min(times)


def _steps(lengths: np.ndarray, samples: int, seq_length: int) -> dict:
    """The build's steps for one prefix and one epoch, timed apart: the document index (numpy: ``mgrid`` over the
    documents, ``RandomState.shuffle``), the sample index (C++ ``helpers.build_sample_idx``, one pass over the
    documents), the shuffle index (numpy ``arange`` + ``RandomState.shuffle``), each a whole array in memory."""
    from megatron.core.datasets import helpers
    from megatron.core.datasets.gpt_dataset import _build_document_index, _build_shuffle_index

    rng = np.random.RandomState(SEED)
    documents, document_s = _fastest(_build_document_index, np.arange(len(lengths), dtype=np.int32), 1, rng, False)
    lengths = np.array(lengths)  # megatron copies the mapped lengths in when it reads most of them
    sample_index, sample_s = _fastest(helpers.build_sample_idx, lengths, documents, seq_length, 1,
                                      int(lengths.sum()), True, True)
    _, shuffle_s = _fastest(_build_shuffle_index, samples, samples, rng)
    assert len(sample_index) - 1 == samples
    return {"document_s": document_s, "sample_s": sample_s, "shuffle_s": shuffle_s}


def _blending_indices(weights: list[float], samples: int) -> None:
    """The blend's step, as ``BlendedDataset`` calls it: C++ ``helpers.build_blending_indices`` picks each sample's
    part, scanning every part per sample (samples x parts), into whole int16 + int64 arrays."""
    from megatron.core.datasets import helpers

    helpers.build_blending_indices(np.zeros(samples, dtype=np.int16), np.zeros(samples, dtype=np.int64),
                                   np.asarray(weights, dtype=np.float64), len(weights), samples, False)


def _tokenizer(path: Path) -> None:
    """A two-token word-level tokenizer: the index build reads only its EOD and vocabulary size."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<|endoftext|>": 0, "a": 1}, unk_token="a")).save(str(path))


def _in_child(*args) -> dict:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        return pool.submit(build, *args).result()


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.1, 1.0, 10.0], help="corpora, billions of tokens")
    parser.add_argument("--parts", type=int, default=300, help="a corpus of --parts-of tokens as this many parts")
    parser.add_argument("--parts-of", type=float, default=1.0, help="billions of tokens")
    parser.add_argument("--seq-length", type=int, default=2048)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(SEED)
    root = Path(tempfile.mkdtemp(prefix="dataset_index-", dir="/tmp"))
    rows = []
    try:
        _tokenizer(root / "tokenizer.json")
        runs = [(size, 1) for size in args.sizes] + ([(args.parts_of, args.parts)] if args.parts > 1 else [])
        for size, parts in runs:
            tokens = int(size * 1e9)
            lengths = document_lengths(tokens, rng)
            where = root / f"{size:g}B-{parts}"
            where.mkdir()
            start = time.perf_counter()
            for k, part in enumerate(np.array_split(lengths, parts)):
                write_dataset(where / f"train-{k:05d}-of-{parts:05d}", part)
            write_s, docs = time.perf_counter() - start, len(lengths)
            del lengths  # not in the forked build's memory
            samples = (tokens - 1) // args.seq_length  # one epoch
            entry = f"{where.name}/" if parts > 1 else f"{where.name}/train-00000-of-00001"
            result = _in_child(entry, str(root), str(root / "tokenizer.json"), samples, args.seq_length,
                               str(root / f"cache-{where.name}"))
            rows.append({"tokens": tokens, "docs": docs, "samples": samples, "parts": parts,
                         "write_s": write_s, **result})
            print(f"  built: {size:g}B tokens in {parts} part(s)", flush=True)
            shutil.rmtree(where)
    finally:
        shutil.rmtree(root)
    _report(rows, args.seq_length)
    return rows


def _report(rows: list[dict], seq_length: int) -> None:
    print(f"\nmegatron GPTDataset index build, seq_length {seq_length}, one epoch; DCLM-like documents "
          f"(lognormal, median {MEDIAN_TOKENS} tokens); a process per build")
    print(f"{'tokens':>7} {'parts':>5} {'docs':>11} {'samples':>10} {'build s':>8} {'(CPU s)':>8} {'cache load s':>12} "
          f"{'peak RSS MiB':>12} {'+RSS MiB':>9} {'indices MiB':>11} {'.bin read kB':>12}")
    for r in rows:
        print(f"{r['tokens'] / 1e9:>6g}B {r['parts']:>5} {r['docs']:>11,} {r['samples']:>10,} {r['build_s']:>8.2f} "
              f"{r['build_cpu_s']:>8.2f} {r['load_s']:>12.3f} {r['peak_mib']:>12.0f} {r['grow_mib']:>9.0f} "
              f"{r['index_mib']:>11.1f} {r['bin_kib']:>12}")
    print(f"\nCPU seconds (the .idx write: wall)\n{'tokens':>7} {'parts':>5} {'.idx write s':>12} {'expand s':>8} "
          f"{'digest s':>8} "
          f"{'doc index s':>11} {'sample index s':>14} {'shuffle index s':>15} {'blend index s':>13}")
    for r in rows:
        steps = " ".join(f"{r[k]:>{w}.3f}" if k in r else f"{'-':>{w}}"
                         for k, w in (("document_s", 11), ("sample_s", 14), ("shuffle_s", 15), ("blend_s", 13)))
        print(f"{r['tokens'] / 1e9:>6g}B {r['parts']:>5} {r['write_s']:>12.2f} {r['expand_s']:>8.3f} "
              f"{r['digest_s']:>8.3f} {steps}")
    single = [r for r in rows if r["parts"] == 1]
    for small, large in zip(single, single[1:]):
        print(f"\ngrowth {small['tokens'] / 1e9:g}B -> {large['tokens'] / 1e9:g}B "
              f"(x{large['tokens'] / small['tokens']:g} tokens): build x{large['build_s'] / small['build_s']:.1f} "
              f"(CPU x{large['build_cpu_s'] / small['build_cpu_s']:.1f}), "
              f"+RSS x{large['grow_mib'] / max(small['grow_mib'], 1):.1f}, "
              f"indices x{large['index_mib'] / small['index_mib']:.1f}", end="")
    if len(single) >= 2:
        small, large = single[-2], single[-1]
        scale = 1e12 / large["tokens"]
        k = np.log(large["build_cpu_s"] / small["build_cpu_s"]) / np.log(large["tokens"] / small["tokens"])
        print(f"\nprojected to 1T tokens in one prefix from {large['tokens'] / 1e9:g}B: build "
              f"{large['build_cpu_s'] * scale / 60:.0f} min CPU linear, "
              f"{large['build_cpu_s'] * scale ** k / 60:.0f} min as tokens^{k:.2f} (the last two sizes' growth); "
              f"+RSS {large['grow_mib'] * scale / 1024:.0f} GiB, "
              f"indices {large['index_mib'] * scale / 1024:.0f} GiB on disk, cache digest "
              f"{large['digest_s'] * scale:.0f} s per rank (.idx in page cache)")
    for r in rows:
        if "blend_s" in r:
            print(f"blend index of {r['parts']} parts at 1T tokens (samples x parts): "
                  f"{r['blend_s'] * 1e12 / r['tokens'] / 60:.0f} min, {1e12 / seq_length * 10 / 2 ** 30:.1f} GiB")


if __name__ == "__main__":
    main()
