"""The probes (training/components/probes.py): the profiler, the collective audit and the sync audit each watch the
one step they are set to, and write their report of it; the other steps run unwatched."""

import json

import torch
import torch.distributed as dist

from stem_megatron.config import RunConfig
from stem_megatron.training.components.probes import Probes


def test_each_probe_watches_its_own_step_only(world_of_one, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)  # the sync audit's CUDA calls, on a CPU
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    cfg = RunConfig(out_dir=str(tmp_path))
    cfg.logging.profile_step, cfg.logging.collective_audit, cfg.logging.sync_audit = 2, 3, 4
    probes = Probes(cfg)
    for step in range(1, 6):
        with probes.around(step):
            dist.all_reduce(torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "collective_audit_step3.json", "profile_step2.json", "profile_step2.txt", "sync_audit_step4_rank0.txt"]
    assert json.loads((tmp_path / "profile_step2.json").read_text())["step"] == 2
    audit = json.loads((tmp_path / "collective_audit_step3.json").read_text())
    assert [call["op"] for call in audit["calls"]["0"]] == ["allreduce"]  # the step's, not the audit's gather
    out = capsys.readouterr().out
    assert "collective audit, step 3: 1 collectives on 1 ranks" in out
    assert "sync audit, step 4: 0 synchronising CUDA calls on rank 0" in out
