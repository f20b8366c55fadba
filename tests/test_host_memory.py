"""Host memory is checked before any table exists: a node whose shared-memory directory cannot hold its STEM
tables stops at start with the bytes needed, the bytes there and the fixes (exit code 1), where mapping
the tables used to die later with a bare bus error (signal 7, exit 135)."""

import subprocess
import sys

import pytest
import torch
from conftest import VOCAB


@pytest.mark.slow
def test_a_small_shared_memory_directory_is_a_clear_error_at_start(corpus, tmp_path):
    """A 64 MB /dev/shm (a container's default) in a mount namespace of its own, and tables of 0.56 GiB."""
    train = [sys.executable, "-m", "stem_megatron.train", "parallel=single", "model.vocab_size=65536",
             f"data.vocab_size={VOCAB}", f"data.dir={corpus}", f"out_dir={tmp_path / 'run'}", "train.steps=2",
             "train.eval_iters=0"]
    script = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"'
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *train],
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in out, out[-3000:]
    assert "the STEM host tables of this node need 0.56 GiB in /dev/shm" in out
    assert "0.06 GiB free" in out and "--shm-size" in out and "host_tables.shm_dir" in out


GIB = 2**30


def _machine(tmp_path, monkeypatch, available_gib: float, cgroup: str = "", files: dict = {}) -> None:
    """This process as a machine with ``available_gib`` of MemAvailable, in the cgroup line ``cgroup`` of
    /proc/self/cgroup whose files under /sys/fs/cgroup are ``files`` {relative path: text}."""
    from stem_megatron.host_tables import node

    (tmp_path / "meminfo").write_text(f"MemTotal: 999999999 kB\nMemAvailable: {int(available_gib * GIB) // 1024} kB\n")
    (tmp_path / "self_cgroup").write_text(cgroup)
    for path, text in files.items():
        (tmp_path / "cg" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "cg" / path).write_text(text)
    monkeypatch.setattr(node, "MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(node, "SELF_CGROUP", str(tmp_path / "self_cgroup"))
    monkeypatch.setattr(node, "CGROUPS", str(tmp_path / "cg"))


V2 = {"job/memory.max": str(4 * GIB), "job/memory.current": str(int(1.5 * GIB)),
      "job/memory.stat": f"anon 1\ninactive_file {GIB // 2}\n"}


@pytest.mark.parametrize("available, cgroup, files, expected, source", [
    (8, "0::/\n", {"memory.max": "max", "memory.current": "1"}, 8, "MemAvailable"),
    (8, "0::/job\n", V2, 3, "cgroup memory limit"),  # 4 GiB limit, 1.5 used of which 0.5 reclaimable
    (2, "0::/job\n", V2, 2, "MemAvailable"),  # the machine has less than the cgroup's room
    (8, "4:memory:/a/b\n1:cpu:/\n", {"memory/a/b/memory.limit_in_bytes": "9223372036854771712",
                                     "memory/a/b/memory.usage_in_bytes": "5"}, 8, "MemAvailable"),  # v1, no limit
    (8, "4:cpuacct,memory:/a\n", {"memory/memory.limit_in_bytes": str(2 * GIB),  # v1 in a cgroup namespace
                                  "memory/memory.usage_in_bytes": str(GIB),
                                  "memory/memory.stat": "total_inactive_file 0\n"}, 1, "cgroup memory limit"),
])
def test_the_tables_may_take_mem_available_bounded_by_a_cgroup_limit(tmp_path, monkeypatch, available, cgroup, files,
                                                                     expected, source):
    from stem_megatron.host_tables.node import available_memory

    _machine(tmp_path, monkeypatch, available, cgroup, files)
    got, said = available_memory()
    assert got == expected * GIB and source in said
    assert available_memory(host_memory_gib=100) == (100 * GIB, "host_tables.host_memory_gib")


def _map_64_mib(directory: str, meminfo: str, host_memory_gib) -> str:
    """In a world of one: map a 64 MiB node-shared tensor with the machine's MemAvailable read from ``meminfo``;
    "mapped" or the error."""
    import torch.distributed as dist

    from stem_megatron.host_tables import node

    node.MEMINFO, node.SELF_CGROUP = meminfo, "/nonexistent"
    try:
        tensors = node.shared_tensors({"t": ((16, 2**20), torch.float32)}, dist.group.WORLD,
                                      lambda name, t: t.fill_(1.0), directory, host_memory_gib)
        return "mapped" if tensors["t"].sum().item() == 16 * 2**20 else "wrong"
    except node.HostMemoryError as e:
        return str(e)


def test_a_vm_that_understates_its_memory_runs_with_host_tables_host_memory_gib(tmp_path, monkeypatch):
    """A microVM whose RAM grows as it is used reports 16 MiB available: tables of 64 MiB are refused at start with the
    figure's source and the override named, and map once ``host_tables.host_memory_gib`` says what the node can give."""
    import distributed

    _machine(tmp_path, monkeypatch, 16 / 1024)
    meminfo = str(tmp_path / "meminfo")
    refused, mapped = (distributed.run(_map_64_mib, 1, str(tmp_path), meminfo, gib)[0] for gib in (None, 1))
    assert "need 0.06 GiB" in refused and "0.02 GiB of available memory (MemAvailable)" in refused
    assert "host_tables.host_memory_gib=<GiB the node can give>" in refused
    assert mapped == "mapped"
