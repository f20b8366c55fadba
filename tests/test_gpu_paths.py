"""The GPU branches, guarded on a CPU machine (docs/gpu.md): Transformer Engine layer specs built from
stand-in TE classes (``te_stand_ins``), a FusedAdam-like optimizer, and the CUDA-only orderings and
precisions of the host-table path checked through the interfaces that carry them.

Model code runs in spawned processes (``distributed.run``): megatron on CPU installs a global torch
function mode and process group, and the stand-ins patch megatron modules, neither of which may leak
into the pytest process.
"""

import contextlib
import queue
import random
import threading
import time

import distributed
import pytest
import torch

from stem_megatron.config import (
    HashMoEConfig,
    HostTablesConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    STEMConfig,
    TrainConfig,
)
from stem_megatron.model.sharding import global_name

V, SEQ = 64, 16
MODEL = ModelConfig(num_layers=3, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=V,
                    seq_length=SEQ)


# --------------------------------------------------------------- Transformer Engine layer specs
def _te_and_local(variant):
    """The same weights in the TE-spec model (stand-ins) and the local-spec model: parameter names mapped,
    checkpoint keys, pre-MLP norms of the replaced layers, logits."""
    import te_stand_ins
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.transformer.identity_op import IdentityOp

    from stem_megatron.checkpoint.dense import METADATA
    from stem_megatron.model.gpt import build_gpt, transformer_config
    from stem_megatron.model.sharding import load_full_weights, local_to_global
    from stem_megatron.model.token_context import token_ids

    te_stand_ins.install()
    stem, experts = STEMConfig(variant=variant, ratio="full"), HashMoEConfig(num_experts=4)
    config = transformer_config(MODEL, ParallelConfig(), on_gpu=False, stem=stem, hash_moe=experts)
    local, te = (build_gpt(MODEL, stem, config, use_te=te, hash_moe=experts) for te in (False, True))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # no parameter keeps its init (norm weights of ones would hide a missing norm)
        for p in local.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    full = {name: p.detach().clone() for name, p in local.named_parameters()}
    load_full_weights(te, full)

    def checkpoint_keys(model):
        return sorted(sh.key for sh in nested_values(model.sharded_state_dict(metadata=METADATA))
                      if isinstance(sh, ShardedTensor))

    tokens = torch.randint(0, V, (2, SEQ), generator=g)
    positions = torch.arange(SEQ).expand(2, SEQ)
    with torch.no_grad(), token_ids(tokens, V):
        diff = (te(tokens, positions, None) - local(tokens, positions, None)).abs().max().item()
    return {"names": sorted(local_to_global(te).values()), "local_names": sorted(full),
            "te_keys": checkpoint_keys(te), "local_keys": checkpoint_keys(local),
            "identity_pre_mlp_norm": [i for i, layer in enumerate(te.decoder.layers)
                                      if i > 0 and isinstance(layer.pre_mlp_layernorm, IdentityOp)],
            "logit_diff": diff}


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["stem", "stem_dagger", "stem_gate", "hash_moe"])
def test_te_layers_keep_their_pre_mlp_norm_and_local_names(variant):
    """Finding 1 and 3: under TE a replaced layer keeps its pre-MLP RMSNorm (megatron's dense TE layer fuses
    it into linear_fc1, which a STEM layer does not have), every TE parameter maps to the single-process
    (local) name an export uses, both specs save the same checkpoint keys, and the models agree."""
    out = distributed.run(_te_and_local, 1, variant)[0]
    assert out["identity_pre_mlp_norm"] == [], "replaced layers without a pre-MLP norm under TE"
    assert out["names"] == out["local_names"]
    assert out["te_keys"] == out["local_keys"]
    assert out["logit_diff"] < 1e-5, out["logit_diff"]


def test_export_names_of_te_and_grouped_gemm_parameters():
    """Finding 3: TE's fused-norm and grouped-GEMM names become the single-process model's names, with the
    stage's layer offset and the EP rank's expert offset applied."""
    cases = {
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": "decoder.layers.2.input_layernorm.weight",
        "decoder.layers.1.mlp.linear_fc1.layer_norm_weight": "decoder.layers.3.pre_mlp_layernorm.weight",
        "decoder.layers.1.mlp.experts.linear_fc1.weight3":
            "decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight",
        "decoder.layers.0.mlp.experts.linear_fc2.weight0":
            "decoder.layers.2.mlp.experts.local_experts.4.linear_fc2.weight",
        "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight":
            "decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight",
        "decoder.layers.1.self_attention.linear_qkv.weight": "decoder.layers.3.self_attention.linear_qkv.weight",
        "decoder.final_layernorm.weight": "decoder.final_layernorm.weight",
    }
    for te_name, single_process in cases.items():
        assert global_name(te_name, offset=2, expert_offset=4) == single_process


def _bf16_attention_softmax():
    """megatron's attention softmax as a GPU run's config (bf16) builds it, on a bf16 input."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    from stem_megatron.model.gpt import transformer_config

    config = transformer_config(MODEL, ParallelConfig(), on_gpu=True)
    softmax = FusedScaleMaskSoftmax(input_in_fp16=False, input_in_bf16=config.bf16, attn_mask_type=AttnMaskType.causal,
                                    scaled_masked_softmax_fusion=config.masked_softmax_fusion,
                                    mask_func=attention_mask_func, softmax_in_fp32=True, scale=None)
    probs = softmax(torch.randn(2, 4, 32, 32, dtype=torch.bfloat16), None)
    return probs.dtype, float(probs.float().sum(-1).mean())


def test_gpu_config_without_te_needs_no_fused_softmax_kernel():
    """Finding 4: a bf16 (GPU) run without Transformer Engine used megatron's fused masked softmax, whose
    CUDA extension no installed package ships (ModuleNotFoundError at the first forward)."""
    dtype, row_sum = distributed.run(_bf16_attention_softmax, 1)[0]
    assert dtype == torch.bfloat16 and abs(row_sum - 1.0) < 1e-2


def _bf16_model_forward():
    """The model as a GPU run's config (bf16) builds it, one forward: its parameter dtypes and torch's warnings."""
    import warnings

    from stem_megatron.model.gpt import build_gpt, transformer_config
    from stem_megatron.model.token_context import token_ids

    config = transformer_config(MODEL, ParallelConfig(), on_gpu=True, use_cpu_initialization=True)
    model = build_gpt(MODEL, STEMConfig(variant="stem", ratio="1/3"), config)
    tokens = torch.randint(0, V, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught, torch.no_grad(), token_ids(tokens, V):
        warnings.simplefilter("always")
        logits = model(tokens, torch.arange(SEQ).expand(2, SEQ), None)
    return {str(p.dtype) for p in model.parameters()}, str(logits.dtype), [str(w.message) for w in caught]


def test_bf16_model_keeps_every_parameter_in_bf16():
    """A GPU run printed torch's "Mismatch dtype between input and weight ... Cannot dispatch to fused
    implementation" at every step: megatron's torch RMSNorm kept an fp32 weight in a bf16 model."""
    dtypes, logits, warned = distributed.run(_bf16_model_forward, 1)[0]
    assert dtypes == {"torch.bfloat16"} and logits == "torch.bfloat16"
    assert not [w for w in warned if "Mismatch dtype" in w], warned


# ------------------------------------------------------------------------- FusedAdam and resume
class FusedAdamStandIn(torch.optim.Optimizer):
    """What megatron relies on of TE's FusedAdam: AdamW with ``step`` counted in the param group (not per
    parameter), state ``exp_avg``/``exp_avg_sq`` only, and ``state_dict``/``load_state_dict`` that look
    every per-parameter state name up in their dtype map (an unknown name raises KeyError, as TE does)."""

    name_to_dtype_map = {"exp_avg": torch.float32, "exp_avg_sq": torch.float32, "master_param": torch.float32}

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adam_w_mode=True,
                 capturable=False):  # megatron-core 0.19 passes capturable (its optimizer_cuda_graph), as TE takes it
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    def initialize_state(self, param):
        self.state[param].update(exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))

    def state_dict(self):
        state_dict = super().state_dict()
        state_dict["state"] = {k: {name: v[name] for name in v if self.name_to_dtype_map[name]}
                               for k, v in state_dict["state"].items()}
        return state_dict

    def load_state_dict(self, state_dict):
        for v in state_dict["state"].values():
            for name in v:
                self.name_to_dtype_map[name]  # TE's set_scaled_state: KeyError for a state it does not keep
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self.initialize_state(p)
                m, v = self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat, v_hat = m / (1 - beta1 ** group["step"]), v / (1 - beta2 ** group["step"])
                p.mul_(1 - group["lr"] * group["weight_decay"]).addcdiv_(m_hat, v_hat.sqrt().add_(group["eps"]),
                                                                         value=-group["lr"])


def _resume_with_fused_adam(directory):
    """Two steps with the FusedAdam stand-in, a checkpoint, a fresh model and optimizer loaded from it."""
    from megatron.core import optimizer as megatron_optimizer
    from megatron.core.optimizer import distrib_optimizer

    from stem_megatron.checkpoint import dense
    from stem_megatron.training.setup import setup_model
    from stem_megatron.training.step import train_step

    # megatron picks TE's FusedAdam when TE is installed: make it pick the stand-in, with TE's semantics
    megatron_optimizer.Adam, megatron_optimizer.USING_PYTORCH_OPTIMIZER = FusedAdamStandIn, False
    distrib_optimizer.Adam = FusedAdamStandIn
    distrib_optimizer.HAVE_APEX_OR_TE, distrib_optimizer.USING_TE_OPTIMIZER = True, True
    cfg = RunConfig(model=MODEL, stem=STEMConfig(ratio="full"), host_tables=HostTablesConfig(placement="device"),
                    train=TrainConfig(steps=4, micro_batch_size=2, global_batch_size=2, lr=1e-2))
    g = torch.Generator().manual_seed(0)

    def batches():
        while True:
            s = torch.randint(0, V, (2, SEQ + 1), generator=g)
            yield {"tokens": s[:, :-1], "labels": s[:, 1:]}

    first = setup_model(cfg)
    data = batches()
    for _ in range(2):
        train_step(first, data, 1, 2, SEQ, V)
    dense.save(first.model, first.optimizer.dense, directory)  # the dense checkpoint's optimizer, as manager's
    second = setup_model(cfg)
    dense.load(second.model, second.optimizer.dense, directory, step=2)

    def state(trainer):
        inner = trainer.optimizer.dense.optimizer
        return ([p.detach().clone() for p in trainer.model.parameters()],
                [{k: v.clone() for k, v in inner.state[p].items()} for pg in inner.param_groups for p in pg["params"]],
                [pg.get("step") for pg in inner.param_groups])

    return {"inner": type(second.optimizer.dense.optimizer).__name__, "first": state(first), "second": state(second)}


@pytest.mark.slow
def test_resume_with_a_fused_adam_optimizer(tmp_path):
    """Finding 2: a checkpoint of a run on TE's FusedAdam loads (no per-parameter ``step`` is injected into
    its state) and restores every weight, both Adam moments and the step count."""
    out = distributed.run(_resume_with_fused_adam, 1, tmp_path / "dense")[0]
    assert out["inner"] == "FusedAdamStandIn"
    weights, moments, steps = out["first"]
    weights2, moments2, steps2 = out["second"]
    assert all(torch.equal(a, b) for a, b in zip(weights, weights2))
    assert moments2 and all(set(m) == {"exp_avg", "exp_avg_sq"} for m in moments2)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(moments, moments2) for k in a)
    assert steps2 == steps == [2] * len(steps)


# ------------------------------------------------------------------------------ host-table path
class RecordingHostToDevice:
    """``HostToDevice`` on the CPU that logs the calls which order GPU work (transfers on the side stream), so
    their order is checked where no stream exists."""

    def __init__(self, log):
        from stem_megatron.host_tables.transfer import HostToDevice

        self.log, self.inner = log, HostToDevice(torch.device("cpu"))
        self.device = self.inner.device

    def transfer(self):
        self.log.append("side stream")
        return RecordingTransfer(self.log, self.inner.transfer())


class RecordingTransfer:
    def __init__(self, log, inner):
        self.log, self.inner = log, inner

    def __enter__(self):
        self.send = self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        self.ready = None
        return self.inner.__exit__(*exc)

    def copy(self, tensor):
        self.log.append("copy")
        return self.send.copy(tensor)

    def gather(self, table, ids):
        self.log.append("gather")
        return self.send.gather(table, ids)


def _cache_ordering():
    from stem_megatron.host_tables.store import HostTableStore, StoreConfig

    log = []
    store = HostTableStore(StoreConfig((1,), vocab_size=16, d_ff=8, init_std=1.0, seed=0,
                                       host=HostTablesConfig(cache_rows=4)))
    tier, record = store.tier, store.record
    tier.h2d = RecordingHostToDevice(log)
    reload, pull = tier.cache.reload, record.pull
    tier.cache.reload = lambda *a: log.append("cache reload") or reload(*a)
    record.pull = lambda *a: log.append("rows made current") or pull(*a)
    tokens = torch.tensor([[1, 2, 3, 1]])
    pipeline = store.stream(iter([{"tokens": tokens}] * 2), 1)
    release, releases = pipeline.release, iter(["step 1 released", "step returned: the prefetcher is released"])
    pipeline.release = lambda: log.append(next(releases)) or release()
    with pipeline as rows:
        next(rows)  # step 1: the counts the cache picks its rows from
        rows.step(0.1)  # no gradients: the tables stay, the cache is (re)filled
        fetched = next(rows)["stem"].fetched.rows[1]
    return log, torch.equal(fetched, store.table(1)[torch.tensor([1, 2, 3])])


@pytest.mark.slow
def test_cache_refresh_is_ordered_before_the_prefetcher_is_released():
    """After a step the rows are made current, then the hot-row cache is re-read from them through a transfer
    (pinned staging, the side stream: no synchronous copy), before the step returns and the training step
    releases the prefetcher; the next fetch reads the cached rows on that same side stream, so after the reload
    in issue order, and gets the current rows."""
    log, rows_ok = distributed.run(_cache_ordering, 1)[0]
    released, reload = log.index("step returned: the prefetcher is released"), log.index("cache reload")
    assert log[reload - 1] == "rows made current", log
    assert log[reload + 1:released] == ["side stream", "gather"], log  # the one layer's rows, staged and sent
    assert log[released + 1] == "side stream", log
    assert rows_ok


class _Done(threading.Event):
    """The end of a stand-in copy engine's work so far (a CUDA event's ``synchronize``)."""

    synchronize = threading.Event.wait


class LateCopies:
    """A copy engine on the CPU whose copies run late (up to 5 ms), in issue order, on a thread of its own, as a
    GPU's copy engine runs behind the host: a staging byte overwritten before its copy ran arrives changed. The
    issuing thread is held up now and then (20 ms), as a thread can be at any point, so that another thread gets
    far ahead meanwhile. Pinned memory is plain memory here; ``allocations`` lists every allocation's size."""

    def __init__(self, seed: int = 0):
        self.allocations, self._work, self._rng = [], queue.Queue(), random.Random(seed)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            self._work.get()()

    def pinned(self, nbytes):
        self.allocations.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    @staticmethod
    def stream():
        return contextlib.nullcontext()

    def to_device(self, host):
        out, delay = torch.empty_like(host), self._rng.random() * 5e-3
        self._work.put(lambda: (time.sleep(delay), out.copy_(host)))
        time.sleep(0.02 if self._rng.random() < 0.1 else 2e-4)  # the issuing thread is held up now and then
        return out

    def record(self):
        done = _Done()
        self._work.put(done.set)
        return done


def test_a_staging_slot_is_handed_out_again_only_after_its_copies_and_grows_when_too_small():
    """GPU staging: a fetch's rows are gathered into a pinned slot of its own, reserved before the first step, and
    copied from there; the slot goes to the next fetch only after the event of its copies, and a fetch larger
    than planned grows it once. Stand-in copies that run late show the bytes each fetch delivered."""
    from stem_megatron.host_tables.transfer import staging_bytes
    from stem_megatron.host_tables.transfer import HostToDevice

    copies = LateCopies()
    planned = staging_bytes(layers=1, rows=4, cols=8, itemsize=4, tokens=4)
    h2d = HostToDevice(torch.device("cpu"), slot_bytes=planned, copies=copies)
    assert copies.allocations == [planned, planned]  # two slots, before any fetch
    table = torch.randn(50, 8)
    sent = []
    for step in range(6):
        ids = torch.randperm(50)[:4]
        with h2d.transfer() as send:
            sent.append((send.gather(table, ids), table[ids].clone()))
        table.add_(1.0)  # the host table moves on right after the fetch, as after an optimizer step
    send.ready.synchronize()
    assert all(torch.equal(got, expected) for got, expected in sent)
    assert copies.allocations == [planned, planned]  # steady state allocates nothing
    with h2d.transfer() as send:
        big = send.gather(table, torch.arange(40))
    send.ready.synchronize()
    assert torch.equal(big, table[:40]) and copies.allocations[2:] == [max(2 * planned, 40 * 8 * 4)]
    with h2d.transfer() as send:  # the other slot grows too; after that, nothing more
        send.gather(table, torch.arange(40))
    with h2d.transfer() as send:
        send.gather(table, torch.arange(40))
    assert len(copies.allocations) == 4


def test_rows_narrowed_on_the_way_pass_through_one_reused_scratch(monkeypatch):
    """Rows that travel in a narrower dtype than the table's (fp32 tables, bf16 model) are gathered a few rows at
    a time into the fetching thread's scratch and cast into the staging slot from there, never through a
    temporary of the whole fetch: the same bytes as ``table[ids].to(bf16)``, whatever the fetch's size."""
    from stem_megatron.host_tables import transfer

    monkeypatch.setattr(transfer, "SCRATCH_BYTES", 3 * 8 * 4)  # three rows a pass
    h2d = transfer.HostToDevice(torch.device("cpu"), dtype=torch.bfloat16, slot_bytes=0, copies=LateCopies())
    table = torch.randn(50, 8)
    scratch = h2d.scratch((8,), torch.float32)
    for n in (1, 3, 7, 50):
        ids = torch.randperm(50)[:n]
        with h2d.transfer() as send:
            got = send.gather(table, ids)
        send.ready.synchronize()
        assert got.dtype == torch.bfloat16 and torch.equal(got, table[ids].to(torch.bfloat16)), n
    assert scratch.shape == (3, 8) and h2d.scratch((8,), torch.float32).data_ptr() == scratch.data_ptr()


def _two_prefetchers(steps: int):
    """Two prefetchers on one store at once (training's and validation's), fetching through stand-in copies that
    run late; the rows, inverse indices and in-step positions every batch delivered, against the host's."""
    from stem_megatron.host_tables.store import HostTableStore, StoreConfig

    layers, tokens = [1, 2, 3, 4, 5], (2, 24)
    store = HostTableStore(StoreConfig(tuple(layers), vocab_size=V, d_ff=32, init_std=1.0, seed=0,
                                       micro_batch_tokens=48, micro_batches=2), copies=LateCopies(seed=1))

    def batches(seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(2 * steps):
            yield {"tokens": torch.randint(0, V, tokens, generator=g)}

    prefetchers = [store.stream(batches(seed), 2, training=False) for seed in (0, 1)]
    wrong = checked = 0
    with contextlib.ExitStack() as stack:
        for p in prefetchers:
            stack.enter_context(p)  # step 1 announced and released
        for step in range(steps):
            for p in prefetchers if step else ():
                p.next_ids()
                p.release()
            for _ in range(2):
                for p in prefetchers:
                    batch = next(p)
                    rows = batch["stem"]
                    rows.fetched.ready.synchronize()
                    uniq = torch.unique(batch["tokens"])
                    at = store.own.position(uniq)
                    for layer in layers:
                        wrong += not torch.equal(rows.fetched.rows[layer], store.record.read[layer][at])
                    wrong += not torch.equal(uniq[rows.inverse], batch["tokens"])
                    wrong += not torch.equal(p.announced[rows.in_step], uniq)
                    checked += len(layers) + 2
    return wrong, checked


@pytest.mark.slow
def test_two_prefetchers_at_once_deliver_the_host_rows_exactly():
    """Issue 30, finding 2: validation's prefetcher and training's fetch through one store at the same time.
    Each fetch stages its rows in a slot no other fetch holds and no copy still reads, so every row, inverse
    index and in-step position arrives as the host holds it. (The shared 8-buffer ring this replaced, driven by the
    same stand-in copies, delivered 2 or 3 of the 336 tensors wrong in 2 of 3 runs: a thread held up between
    taking a buffer and marking its copy let the other thread take the same buffer and overwrite it.)"""
    wrong, checked = distributed.run(_two_prefetchers, 1, 12)[0]
    assert checked == 12 * 2 * 2 * 7 and wrong == 0, f"{wrong} of {checked} fetched tensors differ from the host's"


def test_host_to_device_on_cpu_gathers_without_staging():
    from stem_megatron.host_tables.transfer import HostToDevice

    h2d, table = HostToDevice(torch.device("cpu")), torch.randn(20, 3)
    with h2d.transfer() as send:
        rows = send.gather(table, torch.tensor([4, 2]))
    assert h2d.staging is None and send.ready is None and torch.equal(rows, table[[4, 2]])


class _Store:
    """What ``HostRowSource`` needs of a store: its vocabulary and layers, and a micro-batch's row leaf."""

    vocab_size, layers = V, [1]

    def rows(self, layer, prefetched):
        self.leaf = prefetched.fetched.rows[layer].detach().requires_grad_()
        return self.leaf


def test_repeated_token_gradients_add_up_in_fp32_under_bf16():
    """Finding 7: with a bf16 model (GPU) the gradient of a row used by many tokens is the fp32 sum of their
    bf16 gradients; gathering bf16 rows would add the repeats in bf16 (8 significant bits)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from stem_megatron.host_tables.store import HostRowSource
    from stem_megatron.host_tables.transfer import Fetched, PrefetchedRows
    from stem_megatron.model.token_context import MicroBatchTokens

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, ffn_hidden_size=4,
                               params_dtype=torch.bfloat16)
    source, store = HostRowSource(config, V, _Store()), None
    store = source.store
    source.set_layer_number(1)
    inverse = torch.zeros(4, 512, dtype=torch.long)  # 2048 repeats of one token
    rows = torch.randn(1, 4)
    prefetched = PrefetchedRows(torch.tensor([5]), inverse, Fetched({1: rows}, None, {}))
    out = source(MicroBatchTokens(torch.full((4, 512), 5), prefetched))
    assert out.dtype == torch.bfloat16 and out.shape == (512, 4, 4)
    grad = (torch.rand(out.shape, generator=torch.Generator().manual_seed(0)) + 0.5).to(torch.bfloat16)
    out.backward(grad)
    exact = grad.double().sum(dim=(0, 1))
    assert store.leaf.grad.dtype == torch.float32
    assert torch.allclose(store.leaf.grad[0].double(), exact, rtol=1e-6), (store.leaf.grad[0], exact)


def test_rows_travel_in_the_compute_precision_and_change_nothing():
    """With a bf16 model the rows cross to the device in bf16 (half the bytes of fp32 tables); the layer casts
    its fp32 row leaf to bf16 before any use, so the forward and the row gradients are bitwise those of fp32
    rows. A table narrower than the compute dtype is not widened."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from stem_megatron.host_tables.store import HostRowSource
    from stem_megatron.host_tables.transfer import Fetched, HostToDevice, PrefetchedRows
    from stem_megatron.model.token_context import MicroBatchTokens

    table, ids = torch.randn(20, 4), torch.tensor([3, 7, 11])
    with HostToDevice(torch.device("cpu"), dtype=torch.bfloat16).transfer() as send:
        sent = send.gather(table, ids)
    assert sent.dtype == torch.bfloat16 and torch.equal(sent, table[ids].bfloat16())
    with HostToDevice(torch.device("cpu"), dtype=torch.float32).transfer() as send:
        assert send.gather(table.bfloat16(), ids).dtype == torch.bfloat16
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, ffn_hidden_size=4,
                               params_dtype=torch.bfloat16)
    inverse = torch.randint(0, 3, (2, 6), generator=torch.Generator().manual_seed(1))
    grad = torch.randn(6, 2, 4, generator=torch.Generator().manual_seed(2)).bfloat16()
    results = []
    for rows in (table[ids], sent.float()):
        source = HostRowSource(config, V, _Store())
        source.set_layer_number(1)
        out = source(MicroBatchTokens(ids[inverse], PrefetchedRows(ids, inverse, Fetched({1: rows}, None, {}))))
        out.backward(grad)
        results.append((out.detach(), source.store.leaf.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_the_cpu_adam_thread_runs_on_the_ranks_device(monkeypatch):
    """A rank's "stem-adam" thread waits for copies from its GPU (a working set's leaving rows): it sets the
    rank's device first, or its first CUDA call would open a context on GPU 0, for every rank of the node."""
    from stem_megatron.host_tables.adam_thread import RowUpdates

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append((threading.current_thread().name,
                                                                               device)))
    updates = RowUpdates(False, 1, torch.device("cuda", 3))
    updates.now(lambda: None)
    assert [(name.split("_")[0], device) for name, device in calls] == [("stem-adam", torch.device("cuda", 3))]


def test_the_pinned_pool_is_read_after_cuda_is_initialised(monkeypatch):
    """torch reports the host allocator's statistics as ``{}`` until CUDA is initialised: a GPU test reading them
    first in its process would fail with a KeyError, not on what it checks. A stand-in for that torch."""
    from stem_megatron.host_tables.transfer import pinned_pool_bytes

    initialised = []
    monkeypatch.setattr(torch.cuda, "init", lambda: initialised.append(True))
    monkeypatch.setattr(torch.cuda, "host_memory_stats",
                        lambda: {"allocated_bytes.current": 4096} if initialised else {})
    assert pinned_pool_bytes() == 4096


def test_no_process_is_forked_from_a_rank_whose_cuda_is_up(monkeypatch):
    """megatron's checkpoint writer returns its results through a manager process made at the first save: forked on
    the CPU (it has torch already), spawned once CUDA is initialised, since CUDA does not support a forked child."""
    from stem_megatron.checkpoint import dense

    assert dense.results_manager_start() == "fork"  # this process never initialises CUDA
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert dense.results_manager_start() == "spawn"


# --------------------------------------------------------------- host tensors to the device, host threads
def _device_copies(monkeypatch) -> list:
    """A stand-in CUDA for host-to-device copies: ``pin_memory`` marks its copy pinned, and ``to`` a GPU records
    (whether the source was pinned, whether the copy was non-blocking) and leaves the tensor on the host."""
    copies, to = [], torch.Tensor.to

    def to_stand_in(self, *args, **kwargs):
        device = kwargs.get("device", args[0] if args else None)
        if isinstance(device, (torch.device, str)) and torch.device(device).type == "cuda":
            copies.append((getattr(self, "pinned", False), kwargs.get("non_blocking", False)))
            return self
        return to(self, *args, **kwargs)

    def pin_memory(self):
        pinned = self.clone()
        pinned.pinned = True
        return pinned

    monkeypatch.setattr(torch.Tensor, "to", to_stand_in)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return copies


def test_indices_made_on_the_host_reach_the_device_from_pinned_memory(monkeypatch):
    """A step's slots and routes, made on the host, go to the GPU non-blocking from pinned memory: from pageable
    memory the driver may synchronise with the stream to stage the copy, a stall of the issuing thread. Each place
    that copies them (a route's positions, the rows an owner sends, the fused AdamW's rows and decay, a working set's
    leaving slots) through a stand-in CUDA; on the CPU the tensor itself, with nothing pinned."""
    from types import SimpleNamespace

    from stem_megatron.host_tables.device_tier import OwnerTier
    from stem_megatron.host_tables.exchange import Route
    from stem_megatron.host_tables.row_optimizer import RowOptimizer
    from stem_megatron.host_tables.row_state import RowState
    from stem_megatron.host_tables.transfer import copy_to_device
    from stem_megatron.host_tables.working_set import WorkingSet

    ids, gpu = torch.arange(4), torch.device("cuda", 0)
    assert copy_to_device(ids, torch.device("cpu")) is ids  # before the stand-in: CPU torch cannot pin
    copies = _device_copies(monkeypatch)
    Route(None, ids, ids, [], [], ids, ids, torch.float32, ids, ids).on(gpu)
    resident = SimpleNamespace(slot_of=torch.arange(8), device=gpu, cols=2, rows=lambda layer, at: torch.ones(4, 2))
    OwnerTier._receive(SimpleNamespace(layers=[0], ws=resident, exchange=SimpleNamespace(
        from_owners=lambda routes, rows: rows), stats=OwnerTier.new_stats()), [], ids)
    fused = RowOptimizer(None, "fused", gpu, dense=True)  # its AdamW a stand-in below
    monkeypatch.setattr(fused, "_adamw", lambda step, lr, tensors, at, grads: None)
    state = RowState.zeros([0], 8, 2, torch.device("cpu"))
    fused.update(1, 1e-3, state, 0, ids, torch.ones(4, 2), torch.arange(4), untouched=torch.tensor([5]))
    fused.decay(1, 1e-3, state, 0, ids)
    leaving = SimpleNamespace(ids=torch.arange(4), slot_of=torch.arange(4), layers=[0], device=gpu,
                              stats={"rows_left": 0}, _on_compute=contextlib.nullcontext, _landed=threading.Event(),
                              d2h=SimpleNamespace(copy=lambda tensor, key: (tensor, None)),
                              state=SimpleNamespace(kind=lambda kind: {0: torch.zeros(4, 2)}))
    WorkingSet._evict(leaving, ids)
    assert len(copies) == 5 + 1 + 2 + 1  # a route's five index tensors, the owner's slots, AdamW's rows twice, eviction
    assert all(pinned and non_blocking for pinned, non_blocking in copies), copies


def test_no_host_tensor_goes_to_the_device_non_blocking_outside_the_pinned_paths():
    """Every ``non_blocking`` copy in host_tables/ is in transfer.py, from its pinned staging or ``copy_to_device``:
    a new one elsewhere would copy from pageable memory."""
    import ast
    from pathlib import Path

    import stem_megatron.host_tables as host_tables

    found = []
    for path in sorted(Path(host_tables.__file__).parent.glob("*.py")):
        for call in ast.walk(ast.parse(path.read_text())):
            if isinstance(call, ast.Call) and any(k.arg == "non_blocking" for k in call.keywords):
                found.append(f"{path.name}:{call.lineno}")
    assert found and all(where.startswith("transfer.py:") for where in found), found


@pytest.mark.parametrize("env, cores, threads", [
    ({"LOCAL_WORLD_SIZE": "8"}, 16, 1),  # torchrun, 8 ranks on a 16-core node: 2 cores a rank
    ({"SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_LOCALID": "3"}, 16, 1),  # srun, a rank a GPU, 2 nodes
    ({"SLURM_STEP_TASKS_PER_NODE": "8", "SLURM_CPUS_PER_TASK": "2"}, 16, 1),  # the same, tasks not bound to cores
    ({"SLURM_STEP_TASKS_PER_NODE": "8", "SLURM_CPUS_PER_TASK": "8"}, 8, 4),  # tasks bound to 8 cores each
    ({}, 16, 8),  # one process on the node
], ids=["torchrun", "srun", "srun-unbound", "srun-bound", "alone"])
def test_a_ranks_host_threads_take_its_share_of_the_node(monkeypatch, env, cores, threads):
    """A rank's prefetch and Adam threads split the cores it may use over the ranks sharing them, so the node's ranks
    never run more OpenMP threads than it has cores (16 cores, 8 ranks: 1 + 1 a rank), whether torchrun or srun
    started them. On the CPU a host thread takes no more than the training thread's count either."""
    from stem_megatron.host_tables import node

    for var in ("LOCAL_WORLD_SIZE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_CPUS_PER_TASK", "SLURM_LOCALID"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(node.os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 6)
    assert node.host_threads(torch.device("cuda", 0)) == threads
    assert node.HOST_THREADS * threads <= max(2, cores // node.ranks_sharing_cores())
    assert node.host_threads(torch.device("cpu")) == min(threads, 6)
