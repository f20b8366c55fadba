"""``store.step`` with a working set (``working_set.WorkingSet``, issue 31): what runs between the clip and the next
step's first fetch.

1. AdamW on the working set's slots, the step's gradients where they are (the device); on CPU on the Adam thread,
   whose cores DeepSpeed's kernel uses.
2. Dense Adam only: the rows not resident decay on the host (zero gradients, ``store._update``), first those the next
   step reads, since they enter the set below with their state.
3. The next step's ids admitted: entering rows' state from the host, leaving rows' back to it.
4. Beside the next step (``stem.overlap_update``), on the Adam thread: the leaving rows landed in the host record, and
   dense Adam's other rows. The next step's ``step`` (and ``settle``, ``refresh``) waits for them first.
"""

from __future__ import annotations

import time

import torch


def step_resident(store, step: int, lr: float, next_ids: torch.Tensor) -> None:
    """Step ``step`` of ``store`` (a ``HostTableStore`` with a working set); ``next_ids``: the next step's ids."""
    ws, dense, none = store.resident, store.mode == "dense", torch.empty(0, dtype=torch.int64)

    def update() -> None:
        for layer in store.layers:
            ids, grads, _ = store._grads.pop(layer, (none, torch.empty(0, store.cols, device=store.device), None))
            ws.update(step, lr, layer, ids, grads, dense)
            store._stats["rows_updated"] += store.vocab_size if dense else ids.numel()

    def decay(ids: torch.Tensor) -> None:
        rows = torch.sort(store.own.local(ids)).values
        for layer in store.layers:
            store._update(step, lr, layer, rows, none, torch.empty(0, store.cols), None)

    start = time.perf_counter()
    if ws.kernel == "rows":  # CPU: DeepSpeed's kernel on the Adam thread's cores
        store.updates.now(update)
    else:
        update()
    ws.stats["resident_update_s"] += time.perf_counter() - start
    rest = none
    if dense and store.layers:  # the rows not resident, split by whether they enter now
        outside, read = ws.slot_of < 0, torch.zeros(store.vocab_size, dtype=torch.bool)
        read[next_ids] = True
        entering, rest = (outside & read).nonzero().squeeze(1), (outside & ~read).nonzero().squeeze(1)
        store.updates.now(lambda: decay(entering))
        store._stats["rows_updated_later"] += rest.numel() * len(store.layers)
    land = ws.admit(next_ids)
    store.steps_done = step

    def later() -> None:
        if land is not None:
            land()
        if rest.numel():
            decay(rest)

    store.updates.later(later)
