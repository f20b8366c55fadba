"""The working set's streams on the CPU as torch's CUDA sanitizer (CSAN, ``TORCH_CUDA_SANITIZER=1``) sees them on a GPU.

CSAN keys an access by the tensor, not by the bytes a kernel touches, so a design where one stream writes some rows of
a tensor while another stream reads or writes other rows of it is a "possible data race" to it, however disjoint the
rows. The working set is built so that none arises: its slots' tensors are touched by the compute
stream alone, and the side streams write only tensors of their own, which the compute stream reads after an event.

Here the store's working set is made on ``device="cuda"`` (the CPU redirection every CPU worker runs, ``cpu_compat``,
puts its tensors on the CPU), so it takes its GPU branches; its copy engines and the streams are stand-in lanes
(``Lanes``), and every op's reads and writes of device tensors go, with the lanes' events, waits and host syncs, to
CSAN's own bookkeeping (``torch.cuda._sanitizer.EventHandler``: ``Audit``). A tensor is on the device if it is a slot
tensor, a copy to the device, or made by an op from such a tensor; accesses are keyed by storage, stricter than CSAN's
key (a view's first element). So a report here is one CSAN would make on a GPU for the same order of issue.
"""

import contextlib
import functools
import importlib.util
import itertools
import sys
import threading
import time
from pathlib import Path

import distributed
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
V, COLS, TOKENS, SLOTS, STEPS = 1024, 16, 96, 128, 6  # ~90 distinct ids a step, two steps' ~170 > 128 slots
LATE_S = 0.2  # a preload held back this long would come after the step before's update (a step here: milliseconds)


class Lanes:
    """Stand-in CUDA streams (``compute`` and a side lane per copy engine) whose events, waits and host syncs feed
    CSAN's bookkeeping, with the device storages ``Audit`` reports accesses to and the reports it got back."""

    def __init__(self):
        from torch.cuda._sanitizer import EventHandler

        self.csan, self.lock, self.reports, self.busy = EventHandler(), threading.RLock(), [], set()
        self.device, self.alive = set(), []  # device storages, and their tensors: no address is reused
        self._ids, self._local = itertools.count(1), threading.local()
        self.compute = Lane(self, 0)  # CSAN's default stream

    def lane(self) -> "Lane":
        with self.lock:
            lane = Lane(self, next(self._ids))
            self.csan._handle_stream_creation(lane.id)
        return lane

    def current(self, *_device) -> "Lane":
        """``torch.cuda.current_stream``: a thread issues on the compute lane unless inside ``on``."""
        return getattr(self._local, "lane", self.compute)

    @contextlib.contextmanager
    def on(self, lane: "Lane"):
        """``torch.cuda.stream``."""
        before, self._local.lane = self.current(), lane
        try:
            yield
        finally:
            self._local.lane = before

    def mark(self, tensor: torch.Tensor) -> None:
        with self.lock:
            self.device.add(tensor.untyped_storage().data_ptr())
            self.alive.append(tensor)

    def enter_thread(self) -> None:
        """A host thread's first call (``node.enter_sanitizer``): the CPU redirection and the audit, as CSAN's."""
        from stem_megatron import cpu_compat

        cpu_compat._CudaToCpu().__enter__()
        Audit(self).__enter__()

    def install(self) -> None:
        from stem_megatron.host_tables import node, transfer

        torch.cuda.current_stream, torch.cuda.stream = self.current, self.on
        torch.cuda.set_device = lambda device: None
        torch.Tensor.record_stream = lambda tensor, stream: None  # memory reuse: not what CSAN checks
        transfer.CudaCopies = lambda device: LaneCopies(self)
        node.enter_sanitizer = self.enter_thread


class Lane:
    def __init__(self, lanes: Lanes, id: int):
        self.lanes, self.id = lanes, id

    def record_event(self) -> "LaneEvent":
        event = LaneEvent(self.lanes)
        event.record(self)
        return event

    def wait_event(self, event: "LaneEvent") -> None:
        with self.lanes.lock:
            self.lanes.csan._handle_event_wait(event.id, self.id)

    def wait_stream(self, other: "Lane") -> None:
        self.wait_event(other.record_event())


class LaneEvent:
    _ids = itertools.count(1)

    def __init__(self, lanes: Lanes):
        self.lanes, self.id = lanes, next(self._ids)
        with lanes.lock:
            lanes.csan._handle_event_creation(self.id)

    def record(self, lane: Lane) -> None:
        with self.lanes.lock:
            self.lanes.csan._handle_event_record(self.id, lane.id)

    def synchronize(self) -> None:  # the host waits: every lane is ordered after the event (as CSAN has it)
        with self.lanes.lock:
            self.lanes.csan._handle_event_synchronization(self.id)


class LaneCopies:
    """``pinned.CudaCopies`` on a side lane of its own: plain memory for pinned, copies made at once."""

    def __init__(self, lanes: Lanes):
        self.lanes, self.side = lanes, lanes.lane()

    @staticmethod
    def pinned(nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def stream(self):
        return self.lanes.on(self.side)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(host)
        self.lanes.mark(out)
        return out.copy_(host)  # written on the lane current here

    def record(self) -> LaneEvent:
        return self.side.record_event()


def _storages(value):
    return {t.untyped_storage().data_ptr() for t in tree_leaves(value)
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr()}


class Audit(TorchDispatchMode):
    """Each op's reads and writes of device storages, on the lane it was issued on, checked by CSAN's bookkeeping.
    As CSAN: a view reads nothing, ``*_like``/``new_*`` read only metadata, outputs are written."""

    def __init__(self, lanes: Lanes):
        super().__init__()
        self.lanes = lanes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.cuda._sanitizer import FACTORY_FUNCTION_REGEX, zip_arguments

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        factory = FACTORY_FUNCTION_REGEX.match(func._schema.name)
        reads, writes, inputs = set(), set(), set()
        for argument, value in zip_arguments(func._schema, args, kwargs):
            storages, alias = _storages(value), argument.alias_info
            inputs |= storages
            if alias is not None and alias.is_write:
                writes |= storages
            elif alias is None and not factory:
                reads |= storages
        returned = func._schema.returns[0].alias_info if func._schema.returns else None
        made = set() if returned is not None and not returned.is_write else _storages(out)
        lanes = self.lanes
        with lanes.lock:
            if inputs & lanes.device:  # made from device tensors: on the device
                for t in (t for t in tree_leaves(out) if isinstance(t, torch.Tensor)):
                    if t.untyped_storage().data_ptr() not in inputs:
                        lanes.mark(t)
            written = (writes | made) & lanes.device
            read = (reads & lanes.device) - written
            if read or written:
                lanes.busy.add(lanes.current().id)
                lanes.reports += lanes.csan._handle_kernel_launch(
                    lanes.current().id, read, written, made & lanes.device, func._schema,
                    {ptr: [] for ptr in read | written})
        return out


def _harness():
    spec = importlib.util.spec_from_file_location("row_sync", ROOT / "benchmarks" / "row_sync.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["row_sync"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _on_lanes(store, lanes: Lanes):
    """``store``'s working set made anew on the stand-in device (``cuda``, which the CPU redirection maps to the CPU):
    its GPU branches, its copies on lanes, torch's fused AdamW."""
    from stem_megatron.host_tables.row_optimizer import RowOptimizer
    from stem_megatron.host_tables.row_state import KINDS
    from stem_megatron.host_tables.working_set import WorkingSet

    cpu, cuda = store.tier.ws, torch.device("cuda")
    moving = min(SLOTS, TOKENS)  # as the store reserves for (DP = 1: a step reads at most its tokens' ids)
    slots = RowOptimizer(store.optimizer.adam, "fused", cuda, store.optimizer.dense)
    store.tier.ws = WorkingSet(store.layers, SLOTS, V, COLS, cuda, cpu.travel, store.record, slots, ahead=True,
                               moving_rows=moving, tokens=TOKENS)
    for kind in KINDS:
        for tensor in store.tier.ws.state.kind(kind).values():
            lanes.mark(tensor)


def _working_set_steps(optimizer: str, on_lanes: bool) -> dict:
    """tests/test_gpu.py's working-set script: ``STEPS`` steps of ``backward_one_step`` on a set of ``SLOTS`` rows a
    layer through the store's pipeline, whose prefetch thread preloads the next step's rows while a step runs.
    ``on_lanes``: on the stand-in device, every access audited; else on the CPU. Both run torch's fused AdamW (the
    GPU's kernel). Returns the CSAN reports, the lanes that touched device tensors, the rows moved and the tables and
    moments after."""
    from stem_megatron.config import HostTablesConfig
    from stem_megatron.host_tables.store import HostTableStore, StoreConfig

    harness = _harness()
    store = HostTableStore(StoreConfig((1, 2), V, COLS, init_std=0.02, seed=0,
                                       host=HostTablesConfig(resident_rows=SLOTS, optimizer=optimizer),
                                       micro_batch_tokens=TOKENS, micro_batches=1, compute_dtype=torch.bfloat16))
    store.tier.ws.optimizer.kernel = "fused"
    lanes = Lanes() if on_lanes else None
    if lanes is not None:
        lanes.install()
        Audit(lanes).__enter__()
        _on_lanes(store, lanes)
    draw = lambda step: torch.randint(0, V, (1, TOKENS), generator=torch.Generator().manual_seed(step))  # noqa: E731
    moved = {"stem_rows_entered_ahead": 0, "stem_rows_entered_staged": 0, "stem_rows_left": 0}
    with store.stream(harness.token_batches(draw, STEPS), 1) as rows:
        for _ in range(STEPS):
            harness.backward_one_step(rows, store)
            rows.step(1e-2)
            stats = store.take_stats()
            for key in moved:
                moved[key] += stats[key]
    store.settle()
    state = store.record.state
    tables = {(layer, kind): (store.table(layer) if kind == "master" else state.kind(kind)[layer]).float().clone()
              for layer in store.layers for kind in ("master", "exp_avg", "exp_avg_sq")}
    audited = {"reports": [str(r) for r in lanes.reports], "lanes": len(lanes.busy)} if lanes is not None else {}
    return {**audited, "moved": moved, "tables": tables}


@contextlib.contextmanager
def _late_preloads():
    """Every ``WorkingSet.preload`` held back ``LATE_S`` on the prefetch thread, as a busy host would hold it."""
    from stem_megatron.host_tables.working_set import WorkingSet

    preload = WorkingSet.preload

    def late(self, ids: torch.Tensor) -> None:
        time.sleep(LATE_S)
        preload(self, ids)
    WorkingSet.preload = late
    try:
        yield
    finally:
        WorkingSet.preload = preload


def _three(optimizer: str) -> tuple[dict, dict, dict]:
    """The GPU branches' run, the CPU branches' run and the CPU branches' run with every preload held back."""
    plain = _working_set_steps(optimizer, on_lanes=False)  # first: the stand-ins stay installed in this process
    with _late_preloads():
        late = _working_set_steps(optimizer, on_lanes=False)
    return _working_set_steps(optimizer, on_lanes=True), plain, late


@functools.cache
def _runs(optimizer: str) -> tuple[dict, dict, dict]:
    """``_three`` in one forked worker, once a session for the tests below."""
    return distributed.run(_three, 1, optimizer)[0]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["lazy", "dense"])
def test_no_tensor_of_the_working_set_is_shared_by_two_streams_without_an_event(optimizer):
    """Rows enter ahead (loaded while the step before runs), enter staged and leave every step; CSAN's bookkeeping
    finds no access to a device tensor on one lane after another lane's conflicting access without an event between
    (the hazard it guards: a preload writing the slots' tensors on the side stream while the compute stream reads them).
    The GPU branches end with the CPU branches' tables and moments, bitwise."""
    audited, plain, _ = _runs(optimizer)
    assert all(audited["moved"].values()), audited["moved"]
    assert audited["lanes"] == 3, audited["lanes"]  # the compute stream's and both copy engines' work was seen
    reports = audited["reports"]
    assert not reports, f"{len(reports)} CSAN reports; the first:\n{reports[0]}"
    for key, value in plain["tables"].items():
        assert torch.equal(audited["tables"][key], value), key


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["lazy", "dense"])
def test_rows_move_and_update_alike_however_late_the_preload(optimizer):
    """The prefetch thread preloads a step before it announces it, so the step before's update and the admission of
    the step's rows, which wait for the announcement, always come after the preload: a preload held back moves the
    same rows ahead and ends with the same tables and moments, bitwise. With dense Adam the values hang on it too: a
    row a step reads next takes the step before's zero-gradient update in the working set (the slots' kernel, torch's
    fused AdamW here as on a GPU) if it loaded ahead before that update, else on the host (DeepSpeed's kernel: other
    rounding); which rows leave to make room decides the same for them."""
    _, plain, late = _runs(optimizer)
    assert late["moved"] == plain["moved"], (late["moved"], plain["moved"])
    for key, value in plain["tables"].items():
        assert torch.equal(late["tables"][key], value), key
