"""Score finished study runs (their exports) and write each ``<run>/eval.json``, one process for all of them.

Measures, on the run's single-process export:
* held-out next-token NLL and top-1 accuracy on the corpus' validation split (the "accuracy" of the
  study's Training ROI, standing in for the paper's downstream average);
* fact recall: share of the synthetic subjects whose top-1 continuation of "The capital of X is" is
  their answer (``stem_megatron.eval.facts``);
* for STEM variants, knowledge-edit success: swap two recalled subjects' rows at every STEM layer and
  count prompts that now give the other subject's answer;
* parameters (total, active per token) and training FLOPs (tokens x FLOPs/token, ``stem_megatron.flops``).

Run: ``python benchmarks/study_eval.py RUN_DIR [RUN_DIR ...] --facts data_cache/python-doc/facts``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's stem_megatron, installed or not
from stem_megatron.setup_check import require_environment  # noqa: E402

require_environment()  # before torch and megatron: another Python gets `make setup`, not a traceback

from stem_megatron.config_moves import upgrade_saved_config  # noqa: E402
from stem_megatron.data.facts import Facts  # noqa: E402
from stem_megatron.eval.facts import edit_success, fact_recall  # noqa: E402
from stem_megatron.eval.perplexity import held_out_perplexity  # noqa: E402
from stem_megatron.flops.arch import arch_from_model_config  # noqa: E402
from stem_megatron.flops.mfu import model_flops_per_token  # noqa: E402
from stem_megatron.flops.params import analytic_parameters  # noqa: E402
from stem_megatron.flops.variants import variant_from_stem_config  # noqa: E402
from stem_megatron.inference.model import InferenceModel  # noqa: E402
from stem_megatron.model.stem_mlp import STEM_VARIANTS  # noqa: E402


def evaluate(run_dir: Path, facts_prefix: Path, valid_windows: int, edit_pairs: int) -> dict:
    config = upgrade_saved_config(json.loads((run_dir / "config.json").read_text()))  # runs in the flat stem layout too
    model = InferenceModel(run_dir / "export", device="cpu")
    valid = Path(config["data"]["dir"]) / (config["data"]["valid_prefixes"] or ["valid"])[0]
    heldout = held_out_perplexity(model, valid, batch_size=16, max_windows=valid_windows)
    facts = Facts.load(facts_prefix.with_suffix(".json"))
    recall = fact_recall(model, facts)
    stem = config["stem"]
    edit = (edit_success(model, facts, recall["recalled"], pairs=edit_pairs) if stem["variant"] in STEM_VARIANTS
            else {"edit_success": None, "edit_flips": None, "edit_stays": None, "pairs": 0})
    arch = arch_from_model_config(config["model"])
    params = analytic_parameters(arch, variant_from_stem_config(stem, config["hash_moe"]), tied=False, qkv_bias=False)
    train = config["train"]
    tokens = train["steps"] * train["global_batch_size"] * config["model"]["seq_length"]
    per_token = model_flops_per_token(config["model"], stem, config["hash_moe"])
    return {"valid_nll": heldout["nll"], "valid_accuracy": heldout["accuracy"], "valid_tokens": heldout["tokens"],
            "fact_recall": recall["recall"], "facts": recall["subjects"], "fact_majority": recall["majority"],
            **edit,
            "params_total": params["total"], "params_active": params["active"],
            "train_tokens": tokens, "flops_per_token": per_token, "train_flops": tokens * per_token}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", type=Path, nargs="+")
    parser.add_argument("--facts", type=Path, required=True, help="facts dataset prefix (PREFIX.json holds the facts)")
    parser.add_argument("--valid-windows", type=int, default=200, help="validation windows of seq_length tokens")
    parser.add_argument("--edit-pairs", type=int, default=100)
    args = parser.parse_args()
    for run_dir in args.run_dirs:
        result = evaluate(run_dir, args.facts, args.valid_windows, args.edit_pairs)
        (run_dir / "eval.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
