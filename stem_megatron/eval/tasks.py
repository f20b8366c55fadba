"""Running lm-eval-harness tasks on a model: built-in tasks by name, or local task YAML files.

The paper's suite (ARC-E/C, BoolQ, PIQA, SIQA, HellaSwag, OBQA, WinoGrande, GSM8K, MMLU: ``stem-eval --tasks
paper``) are lm-eval's built-in tasks and download their datasets from the HF hub (cluster use). Offline, a local
task YAML works: ``dataset_path: json`` with ``dataset_kwargs: {data_files: ...}``. Relative ``data_files`` in a
``task_files`` YAML are resolved against the YAML's directory (lm-eval would use the working directory).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

from lm_eval import simple_evaluate
from lm_eval.api.model import LM
from lm_eval.tasks import TaskManager
from lm_eval.tasks._yaml_loader import load_yaml  # lm-eval's loader (includes, !function), pinned 0.4.13
from lm_eval.utils import handle_non_serializable


def load_task_file(path) -> dict:
    """A task YAML as lm-eval's config dict, with relative ``data_files`` made relative to the YAML."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task file {path} does not exist")
    cfg = load_yaml(path)
    if "task" not in cfg:
        raise ValueError(f"{path} has no `task:` name: it is not an lm-eval task config")
    data_files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    if data_files is not None:
        cfg["dataset_kwargs"]["data_files"] = _resolve(data_files, path.resolve().parent)
    return cfg


def _resolve(files, base: Path):
    if isinstance(files, str):
        return files if "://" in files else str(base / files)  # an absolute path stays as it is
    if isinstance(files, dict):
        return {split: _resolve(f, base) for split, f in files.items()}
    return [_resolve(f, base) for f in files]


def run_tasks(lm: LM, tasks: Sequence[str] = (), task_files: Sequence[str] = (), include_path: Optional[str] = None,
              limit: Optional[float] = None, num_fewshot: Optional[int] = None, log_samples: bool = False,
              seed: int = 1234) -> dict:
    """lm-eval's ``simple_evaluate`` on named tasks (built-in or under ``include_path``) and task files.

    Without ``tasks``, every task defined under ``include_path`` runs. lm-eval's built-in task index
    (~15 s to build) is only loaded when ``tasks`` names some.
    """
    manager = TaskManager(include_path=include_path, include_defaults=bool(tasks))
    names = list(tasks) if tasks or include_path is None else manager.all_subtasks
    specs = names + [load_task_file(f) for f in task_files]
    if not specs:
        raise ValueError("no tasks to run: give task names (e.g. arc_easy) or task files"
                         + (f"; {include_path} defines no task" if include_path else ""))
    return simple_evaluate(model=lm, tasks=specs, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                           log_samples=log_samples, bootstrap_iters=0, random_seed=seed, numpy_random_seed=seed,
                           torch_random_seed=seed, fewshot_random_seed=seed)


def summary(results: dict) -> dict:
    """The JSON-safe part of ``simple_evaluate``'s output worth keeping next to NIAH and perplexity."""
    keep = {k: results[k] for k in ("results", "n-samples", "versions", "n-shot", "higher_is_better") if k in results}
    return json.loads(json.dumps(keep, default=handle_non_serializable))
