"""The GPU paths for real, where ``nvidia-smi`` lists a GPU (deselected elsewhere: tests/conftest.py). The rest of the
suite hides the GPUs, so each test here runs its work in a subprocess given them back (``gpu_env``)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data_cache" / "python-doc"


def _run(args, env, timeout=1800):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)


def test_doctor_trains_on_the_gpu_as_on_the_cpu(gpu_env):
    """stem-doctor's GPU-vs-CPU comparison, the check a new GPU node runs first: every environment check passes
    or warns (Transformer Engine may be absent), and the tiny model's losses on the GPU follow the CPU run's."""
    proc = _run(["-m", "stem_megatron.doctor.cli", "--steps", "5", "--data", str(DEMO)], gpu_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok       GPU training vs CPU" in proc.stdout, proc.stdout


def test_gpu_training_with_host_tables_learns_and_a_working_set_trains_alike(gpu_env, tmp_path):
    """A few bf16 steps of the demo model with host tables on one GPU: finite, falling losses, and none of the
    warnings a GPU run printed at every step (torch's RMSNorm dtype mismatch, NCCL's barrier device guess). The same
    run with a working set of 2,048 rows a layer on the GPU (its rows updated there by torch's fused AdamW, the host
    tables' by CPU Adam) has the same first loss and later ones within 5e-3 relative: the one end-to-end check of
    the working set on a GPU outside the sanitizer (the first-contact review's ``train`` probe)."""
    losses = {}
    for name, extra in (("host", []), ("working set", ["host_tables.resident_rows=2048"])):
        proc = _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m",
                     "stem_megatron.train", "parallel=single", "host_tables.placement=host", *extra, "train.steps=8",
                     "train.eval_iters=0", "checkpoint.resume=false", f"data.dir={DEMO}",
                     f"out_dir={tmp_path / name}"], gpu_env())
        assert proc.returncode == 0, proc.stdout + proc.stderr
        metrics = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses[name] = [json.loads(line)["loss"] for line in metrics]
        for known in ("Mismatch dtype between input and weight", "barrier(): using the device"):
            assert known not in proc.stderr, (name, proc.stderr)
    host, working_set = losses["host"], losses["working set"]
    assert len(host) == 8 and all(math.isfinite(x) for x in host) and host[-1] < host[0], host
    assert len(working_set) == 8 and working_set[0] == host[0], (host, working_set)
    assert all(abs(w - h) <= 5e-3 * abs(h) for h, w in zip(host, working_set)), (host, working_set)


SDPA_FLASH = """
import os, sys, torch
from torch.distributed.elastic.utils.distributed import get_free_port
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(get_free_port()))
from megatron.core.transformer.enums import AttnMaskType
from torch.nn.attention import SDPBackend, sdpa_kernel
from stem_megatron import parallel
from stem_megatron.model.gpt import transformer_config
from stem_megatron.model.sdpa_attention import SDPAttention
from stem_megatron.recipes import compose_run
device, seq = torch.device(sys.argv[1]), int(sys.argv[2])
parallel.initialize(1, 1, 0)
cfg = compose_run(["+experiment=pretrain_1b"])
config = transformer_config(cfg.model, cfg.parallel, on_gpu=device.type == "cuda", stem=cfg.stem)
attention = SDPAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
q = torch.randn(seq, 2, config.num_attention_heads, config.kv_channels, device=device, dtype=torch.bfloat16,
                requires_grad=True)
k, v = (torch.randn(seq, 2, config.num_query_groups, config.kv_channels, device=device, dtype=torch.bfloat16,
                    requires_grad=True) for _ in range(2))
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # the only backend allowed: a call the flash kernel cannot take raises
    attention(q, k, v, None).float().sum().backward()
assert all(t.grad is not None for t in (q, k, v))
print("flash", flush=True)
parallel.destroy()
"""


def test_sdpa_takes_the_flash_kernel_at_1b_shapes(gpu_env):
    """``SDPAttention`` as a 1B layer calls it (GQA, 32 query heads on 8 key/value groups, bf16, causal, no mask
    tensor; micro-batch 2 x 2048) forward and backward with FlashAttention as SDPA's only backend: it takes the
    call, so training runs flash and not the math kernel that stores every s x s score (the first-contact review's
    ``probe_layer`` (a)). On the CPU the script runs with torch's CPU flash kernel (tests/test_gpu_check.py)."""
    proc = _run(["-c", SDPA_FLASH, "cuda", "2048"], gpu_env(), timeout=600)
    assert proc.returncode == 0 and "flash" in proc.stdout, proc.stdout + proc.stderr


SYNC_FREE = """
import sys, torch
from stem_megatron.host_tables.row_optimizer import RowAdam, RowOptimizer
from stem_megatron.host_tables.row_state import KINDS, RowState
from stem_megatron.host_tables.transfer import DeviceToHost
from stem_megatron.model.stem_rows import RowOrder, silu_times_rows
device = torch.device(sys.argv[1])
S, B, COLS, U = map(int, sys.argv[2:6])
g = torch.Generator().manual_seed(0)
index = torch.cat([torch.arange(U), torch.randint(0, U, (S * B - U,), generator=g)])
index = index[torch.randperm(S * B, generator=g)].view(S, B)  # every row read at least once, as a fetch's are
order = RowOrder(*(t.to(device) for t in RowOrder.of(index, U)))  # made on the host, as the prefetcher makes it
index = index.to(device)
rows = (torch.randn(U, COLS, generator=g) * 0.02).to(device).requires_grad_()  # the fetch's fp32 leaf
gate = torch.randn(S, B, COLS, generator=g).to(device, torch.bfloat16).requires_grad_()
state = RowState(*({1: torch.rand(2 * U, COLS, generator=g).to(device) * (0.02 if kind == "master" else 1e-6)}
                  for kind in KINDS))
slots = torch.randperm(2 * U, generator=g)[:U].sort().values  # on the host, as the working set passes them
grads = torch.randn(U, COLS, generator=g).to(device) * 1e-3
adam = RowOptimizer(RowAdam((0.9, 0.95), 1e-8, 0.1), "fused", device)
landing = DeviceToHost(device)
landing.reserve("layer", U * COLS * 4)


def layer():
    out = silu_times_rows(gate, rows, index, order)
    out.backward(torch.ones_like(out))


calls = {"the STEM layer's forward and backward": layer,
         "slot AdamW, lazy": lambda: adam.update(2, 1e-3, state, 1, slots, grads),
         "slot AdamW, dense (the other slots decayed)": lambda: adam.update(3, 1e-3, state, 1, slots[:100], grads[:100],
                                                                            untouched=slots[100:]),
         "a row-gradient landing copy": lambda: landing.copy(grads, "layer")}
synced = []
for name, call in calls.items():
    call()  # once before: compiles, the allocator's first blocks
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    except RuntimeError as error:
        synced.append(f"{name}: {error}")
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
assert not synced, synced
print("no sync", flush=True)
"""


def test_the_stem_layer_slot_adam_and_a_landing_copy_never_synchronise_the_device(gpu_env):
    """At 1B shapes (micro-batch 2 x 2048 tokens on 1,777 distinct rows, d_ff 8192), under torch's sync debug mode
    set to raise: the STEM layer's forward and backward (``silu_times_rows``, compiled on CUDA, its segmented sum
    unchecked), the working set's fused AdamW on slots, lazy and dense (host slot indices, as the set passes them),
    and a row-gradient landing copy (``DeviceToHost``) make no synchronising CUDA call: none of them stalls the
    step's stream (the first-contact review's ``probe_layer`` (c)). On the CPU the script runs without the mode
    (tests/test_gpu_check.py)."""
    proc = _run(["-c", SYNC_FREE, "cuda", "2048", "2", "8192", "1777"], gpu_env(), timeout=600)
    assert proc.returncode == 0 and "no sync" in proc.stdout, proc.stdout + proc.stderr


def test_pinned_staging_delivers_every_fetch_intact(gpu_env):
    """Rows gathered into the pinned staging slots and copied on the side stream equal the host rows of their fetch,
    over more fetches than there are slots, with the host table changed after every fetch (a slot reused while its
    copy is in flight would deliver the next fetch's bytes)."""
    script = """
import torch
from stem_megatron.host_tables.transfer import HostToDevice
h2d = HostToDevice(torch.device("cuda", 0))
table = torch.randn(4096, 256)
fetched, expected = [], []
for step in range(12):
    ids = torch.randint(0, 4096, (3000,))
    with h2d.transfer() as send:
        fetched.append(send.gather(table, ids))
    expected.append(table[ids].clone())
    table.add_(1.0)  # the host table moves on, as after an optimizer step
torch.cuda.current_stream().wait_event(send.ready)
assert all(torch.equal(f.cpu(), e) for f, e in zip(fetched, expected))
print("intact")
"""
    proc = _run(["-c", script], gpu_env(), timeout=600)
    assert proc.returncode == 0 and "intact" in proc.stdout, proc.stdout + proc.stderr


def test_pinned_blocks_are_what_the_memory_plan_counts(gpu_env):
    """The memory plan counts each pinned buffer as torch's caching host allocator holds it, rounded up to a power of
    two (``transfer.pinned_block_bytes``): a 1B working set's staging slot (16,384 rows of d_ff 8192) pins 2 GiB for
    its 1.61 GB, and an odd small request its power of two (the first-contact review's ``probe_layer`` (d))."""
    script = """
import torch
from stem_megatron.host_tables.transfer import pinned_block_bytes, pinned_pool_bytes, working_set_bytes
held = []
for nbytes in (3 * 2**20 + 1, working_set_bytes(16384, 8192, 4096)[0]):
    before = pinned_pool_bytes()
    held.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
    grown = pinned_pool_bytes() - before
    assert grown == pinned_block_bytes(nbytes), (nbytes, grown, pinned_block_bytes(nbytes))
print("as planned")
"""
    proc = _run(["-c", script], gpu_env(), timeout=300)
    assert proc.returncode == 0 and "as planned" in proc.stdout, proc.stdout + proc.stderr


def test_two_threads_fetching_through_one_store_get_the_host_rows(gpu_env):
    """Issue 30, finding 2, on real streams: two threads (training's and validation's prefetchers) fetch 10 layers'
    rows at 350M widths through one HostToDevice at once; every fetch equals the host's rows."""
    script = """
import threading, torch
from stem_megatron.host_tables.transfer import HostToDevice
device = torch.device("cuda", 0)
h2d = HostToDevice(device)
tables = [torch.randn(32000, 2560) for _ in range(10)]
wrong, done = [], []
def fetch(seed):
    torch.cuda.set_device(device)
    g = torch.Generator().manual_seed(seed)
    for _ in range(20):
        ids = torch.randint(0, 32000, (3500,), generator=g).unique()
        with h2d.transfer() as send:
            rows = [send.gather(t, ids) for t in tables]
        send.ready.synchronize()
        wrong.extend(i for i, (t, r) in enumerate(zip(tables, rows)) if not torch.equal(r.cpu(), t[ids]))
        done.append(1)
threads = [threading.Thread(target=fetch, args=(seed,)) for seed in (1, 2)]
for t in threads: t.start()
for t in threads: t.join()
assert len(done) == 40 and not wrong, (len(done), len(wrong))
print("intact")
"""
    proc = _run(["-c", script], gpu_env(), timeout=600)
    assert proc.returncode == 0 and "intact" in proc.stdout, proc.stdout + proc.stderr


def test_row_gradients_land_on_the_host_intact(gpu_env):
    """Row gradients copied into a layer's pinned landing buffer (reserved before the first step) on the side stream
    equal the device tensors they came from once their event has fired, with the device tensors freed and
    overwritten right after the copy is issued (the copy must hold them); the buffer is the reserved one every step."""
    script = """
import torch
from stem_megatron.host_tables.transfer import DeviceToHost, landed
d2h = DeviceToHost(torch.device("cuda", 0))
d2h.reserve(1, 3000 * 256 * 4)
reserved = None
for step in range(8):
    grads = torch.randn(3000 - step, 256, device="cuda")  # no larger than reserved: the buffer is reused
    expected = grads.cpu()
    host, event = d2h.copy(grads, 1)
    del grads
    torch.randn(4096, 256, device="cuda").mul_(2)  # the freed memory is taken again on the compute stream
    landed(event)
    assert torch.equal(host, expected), step
    reserved = reserved or host.data_ptr()
    assert host.data_ptr() == reserved and host.is_pinned()
print("landed")
"""
    proc = _run(["-c", script], gpu_env(), timeout=600)
    assert proc.returncode == 0 and "landed" in proc.stdout, proc.stdout + proc.stderr


WORKING_SET = """
import contextlib, os, sys, torch
from torch.distributed.elastic.utils.distributed import get_free_port
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(get_free_port()))
from stem_megatron import parallel
from stem_megatron.host_tables import transfer
from stem_megatron.config import HostTablesConfig
from stem_megatron.host_tables.store import HostTableStore, StoreConfig
from benchmarks.row_sync import backward_one_step, token_batches
parallel.initialize(1, 1, 0)
device, out, optimizer = torch.device(sys.argv[1]), sys.argv[2], sys.argv[3]
V, TOKENS = 4096, 256  # ~250 distinct ids a step from 4,096: most of a step's rows are new to a set of 384
if device.type == "cuda":  # side streams late: a read that does not wait for their work reads stale rows
    stream = transfer.CudaCopies.stream

    @contextlib.contextmanager
    def late_stream(copies):
        with stream(copies):
            torch.cuda._sleep(40_000_000)  # ~20 ms on the side stream before its work
            yield

    transfer.CudaCopies.stream = late_stream
store = HostTableStore(StoreConfig((1, 2), V, 64, init_std=0.02, seed=0,
                                   host=HostTablesConfig(resident_rows=384, optimizer=optimizer),
                                   micro_batch_tokens=TOKENS, micro_batches=1, compute_dtype=torch.bfloat16), device)
pins = []  # pinned allocations from here on: each one a cudaHostAlloc in the middle of a step
allocate = transfer.CudaCopies.pinned
transfer.CudaCopies.pinned = staticmethod(lambda nbytes: pins.append(nbytes) or allocate(nbytes))
draw = lambda step: torch.randint(0, V, (1, TOKENS), generator=torch.Generator().manual_seed(step))
moved = {"stem_rows_entered": 0, "stem_rows_entered_ahead": 0, "stem_rows_entered_staged": 0, "stem_rows_left": 0}
busy = torch.randn(4096, 4096, device=device) if device.type == "cuda" else None
with store.stream(token_batches(draw, 8), 1) as rows:  # its prefetch thread loads the step after's rows ahead
    for step in range(1, 9):
        if busy is not None:  # the compute stream full while the prefetch thread loads ahead, as in training
            for _ in range(30):
                busy = torch.tanh(busy @ busy)
        backward_one_step(rows, store)
        rows.step(1e-3)
        stats = store.take_stats()
        for key in moved:
            moved[key] += stats[key]
store.settle()
assert not pins, f"pinned memory allocated after the store was built: {pins}"
assert all(moved.values()), moved  # rows entered ahead, staged (dense Adam: decayed in their slots) and left
state = store.record.state
torch.save({(layer, kind): (store.table(layer) if kind == "master" else state.kind(kind)[layer]).float().clone()
            for layer in store.layers for kind in ("master", "exp_avg", "exp_avg_sq")}, out)
print("no pinning", moved)
"""


@pytest.mark.parametrize("optimizer", ["lazy", "dense"])
def test_a_working_set_on_the_gpu_trains_its_rows_as_the_cpu_and_pins_nothing_after_it_is_built(gpu_env, tmp_path,
                                                                                                 optimizer):
    """A working set on the GPU whose rows enter (at the step's end, ahead from another thread while the compute
    stream is busy, and staged by that thread for the step's end; with dense Adam loaded ahead once the host decayed
    them, then updated with the set, or staged and decayed in their slots) and leave every step ends with the CPU
    run's tables and moments: the same rows updated the same steps, torch's fused AdamW against DeepSpeed's kernel
    (the fused kernel run on the CPU over these 8 steps: masters within 1.1e-8, moments within 2.9e-7 relative).
    A row loaded into the wrong slot, before its copy, or landed from a slot not yet updated differs by a whole
    update or more; on the GPU every side stream's work starts ~20 ms late, so a reader that does not wait for it
    reads such a row. And its pinned staging and landing buffers are reserved when the store is built
    (``transfer.working_set_bytes``, ``transfer.staged_bytes``), so no step allocates pinned memory, which would synchronise
    the device."""
    runs = {}
    for device in ("cpu", "cuda"):
        proc = _run(["-c", WORKING_SET, device, str(tmp_path / device), optimizer], gpu_env(), timeout=600)
        assert proc.returncode == 0 and "no pinning" in proc.stdout, proc.stdout + proc.stderr
        runs[device] = torch.load(tmp_path / device)
    for key, cpu in runs["cpu"].items():
        # 8 steps of ~3 eps relative each on values ~0.02 (masters) or their moments; an update is ~1e-3
        torch.testing.assert_close(runs["cuda"][key], cpu, rtol=2e-5, atol=1e-7 if key[1] == "master" else 0.0,
                                   msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("optimizer", ["lazy", "dense"])
def test_the_working_set_s_streams_pass_the_cuda_sanitizer(gpu_env, tmp_path, optimizer):
    """The working-set run above on the GPU under torch's CUDA sanitizer (``TORCH_CUDA_SANITIZER``), its preload
    thread entering it as the host threads do: no kernel reads or writes a slot, a staged row or a landing copy that
    another stream's kernel wrote or read without an event between them. The late side streams above show such a
    race only where its timing lets a wrong value through; the sanitizer finds it whatever the timing."""
    proc = _run(["-c", WORKING_SET, "cuda", str(tmp_path / "tables"), optimizer], gpu_env(TORCH_CUDA_SANITIZER="1"),
                timeout=600)
    assert proc.returncode == 0 and "no pinning" in proc.stdout, proc.stdout + proc.stderr[-20_000:]


def test_a_host_table_step_with_its_prefetch_and_cpu_adam_passes_the_cuda_sanitizer(gpu_env, tmp_path):
    """Three steps of the demo model with a working set on one GPU, validation after each, under torch's CUDA
    sanitizer: the training, prefetch and CPU Adam threads' kernels (the STEM layer's gather and backward, the
    rows' transfers, the working set's updates) all synchronise through events where they share a tensor. The set
    (1,024 rows a layer against ~1,700 distinct ids a step) has rows enter ahead, enter staged and leave. Kernels
    outside torch's dispatcher (Transformer Engine's, apex's) go unchecked (docs/gpu.md)."""
    proc = _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m", "stem_megatron.train",
                 "parallel=single", "host_tables.placement=host", "host_tables.resident_rows=1024", "train.steps=3",
                 "train.eval_interval=1", "train.eval_iters=1", "checkpoint.resume=false", "checkpoint.save=false",
                 f"data.dir={DEMO}", f"out_dir={tmp_path}"], gpu_env(TORCH_CUDA_SANITIZER="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-20_000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(math.isfinite(r["loss"]) for r in records), records
    for moved in ("stem_rows_entered_ahead", "stem_rows_entered_staged", "stem_rows_left"):
        assert sum(r[moved] for r in records), (moved, records)


def test_an_audited_host_table_step_with_validation_beside_it(gpu_env, tmp_path):
    """The demo model with host tables on one GPU, validation after every step (its prefetcher fetches while
    training's does), step 3 audited: the run learns, validates every step, and writes both audits, the sync
    audit counting by thread and call site and the collective audit finding one order."""
    proc = _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m", "stem_megatron.train",
                 "parallel=single", "host_tables.placement=host", "train.steps=5", "train.eval_interval=1",
                 "train.eval_iters=1", "logging.sync_audit=3", "logging.collective_audit=3",
                 "checkpoint.resume=false", "checkpoint.save=false", f"data.dir={DEMO}", f"out_dir={tmp_path}"],
                gpu_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 5 and all(math.isfinite(r["valid_loss"]) for r in records), records
    assert records[-1]["loss"] < records[0]["loss"]
    sync = (tmp_path / "sync_audit_step3_rank0.txt").read_text().splitlines()
    assert sync[0].startswith("step 3, rank 0: ") and sync[0].endswith(" synchronising CUDA calls"), sync
    assert "sync audit, step 3: " in proc.stdout, proc.stdout
    audit = json.loads((tmp_path / "collective_audit_step3.json").read_text())
    assert audit["divergence"] is None and audit["summary"] in proc.stdout


HF_CALIBRATION = """
import os, sys, shutil, torch
from pathlib import Path
from torch.distributed.elastic.utils.distributed import get_free_port
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(get_free_port()))
from transformers import LlamaConfig, LlamaForCausalLM
from stem_megatron import parallel
from stem_megatron.checkpoint.hf.calibration import mean_ffn_inputs
from stem_megatron.config import DataConfig, RunConfig, STEMConfig
data, out = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
hf = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=False))
hf.save_pretrained(out)
shutil.copy(data / "tokenizer.json", out / "tokenizer.json")
parallel.initialize(1, 1, 0)
cfg = RunConfig(stem=STEMConfig(variant="stem_1_3", calibration_tokens=8192, calibration_gib=4096 * 64 * 8 / 2**30),
                data=DataConfig(dir=str(data), vocab_size=4096))
cfg.model.seq_length = 64
def tables(device):
    return {l: m.cpu() for group in mean_ffn_inputs(cfg, out, [1, 2], 4096, torch.device(device)) for l, m in group.items()}
first, again, cpu = tables("cuda"), tables("cuda"), tables("cpu")
assert all(torch.equal(first[l], again[l]) for l in first), "the GPU's means differ run to run"
worst = max(float((first[l] - cpu[l]).abs().max() / cpu[l].abs().max()) for l in first)
assert worst <= 1e-4, worst
print("deterministic", flush=True)
parallel.destroy()
"""


def test_a_tiny_llama_imports_and_converts_to_stem_on_the_gpu(gpu_env, tmp_path):
    """The Hugging Face import on a GPU: a tiny Llama's from_dense means, a layer a pass (one layer's sums in the
    budget), are bitwise the same run to run on the GPU (integer sums: no atomic order shows) and within 1e-4 of the
    CPU's; then stem-train starts STEM-1/3 from it with from_dense tables on one GPU and trains 3 finite steps."""
    hf_dir = tmp_path / "llama"
    proc = _run(["-c", HF_CALIBRATION, str(DEMO), str(hf_dir)], gpu_env(), timeout=600)
    assert proc.returncode == 0 and "deterministic" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    proc = _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m", "stem_megatron.train",
                 "parallel=single", "variant=stem_1_3", f"checkpoint.init_from_hf={hf_dir}", "stem.table_init=from_dense",
                 "stem.calibration_tokens=8192", "model.num_layers=4", "model.hidden_size=64",
                 "model.ffn_hidden_size=96", "model.num_attention_heads=4", "model.num_query_groups=2",
                 "model.vocab_size=4096", "model.seq_length=64", "model.rotary_base=10000", "model.norm_epsilon=1e-6",
                 "train.steps=3", "train.eval_iters=0", "checkpoint.resume=false", f"data.dir={DEMO}",
                 f"out_dir={tmp_path / 'run'}"], gpu_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
