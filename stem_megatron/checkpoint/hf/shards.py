"""A Hugging Face directory's safetensors shards, checked whole before any process group starts
(``model_config.check_hf_import``): the shards its index names are there, each one's header reads and covers the
file (a truncated download does not), and every floating-point weight is finite.

The finiteness check reads every tensor, memory-mapped (``safetensors.safe_open``), as one ``aminmax`` each (NaN
propagates through it): for 1 GiB of bf16 and fp32 tensors on one thread of the 2-core test machine, 1.0 s read from
disk, 0.05-0.15 s from the page cache (the headers alone: 0.4 ms). It runs on the first process of each node only
(``LOCAL_RANK`` 0): the node's other processes would read the same pages again, and that process' refusal ends the
node's job (``python -m stem_megatron.torchrun`` prints it as the job's last line).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

INDEX = "model.safetensors.index.json"


def shard_files(directory: Path) -> list[str]:
    """The shard names: those the index maps tensors to, or without an index every ``*.safetensors``."""
    index = directory / INDEX
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return [p.name for p in sorted(directory.glob("*.safetensors"))]


def shard_problem(directory: Path) -> str | None:
    """What keeps ``directory``'s weights from loading (worded to follow the directory's name), or None."""
    from safetensors import SafetensorError, safe_open

    try:
        files = shard_files(directory)
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSONDecodeError is a ValueError
        return f"has a {INDEX} that is not an index of shards ({type(e).__name__}: {e}): save the model again"
    missing = [f for f in files if not (directory / f).is_file()]
    if missing:
        return (f"has a {INDEX} naming {len(missing)} shard(s) it lacks ({', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''}): an incomplete download; fetch the missing files")
    check_values = int(os.environ.get("LOCAL_RANK", 0)) == 0
    for file in files:
        try:
            with safe_open(str(directory / file), framework="pt") as shard:
                for name in shard.keys() if check_values else ():
                    if not _finite(shard.get_tensor(name)):
                        return (f"has a non-finite weight (NaN or inf) in {name} ({file}): a damaged or diverged "
                                f"save; import a healthy one")
        except (SafetensorError, OSError) as e:
            return (f"has a shard {file} that does not read (safetensors: {e}): truncated or damaged; download or "
                    f"save it again")
    return None


def _finite(tensor: torch.Tensor) -> bool:
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(tensor))).all())
