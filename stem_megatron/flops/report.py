"""One model's report: every count of ``stem-flops`` for an architecture and variant (a JSON-ready
dict), and its text form."""

from __future__ import annotations

from dataclasses import asdict, replace
from fractions import Fraction

from stem_megatron.flops.arch import DEFAULT_SEQ_LENGTH, Arch
from stem_megatron.flops.counts import exact_layer_saving_fraction, exact_saving_fraction, forward_flops, training_flops
from stem_megatron.flops.paper import paper_saving_fraction, table1
from stem_megatron.flops.params import analytic_parameters
from stem_megatron.flops.variants import DENSE, Variant

PLAN_RATIOS = ("all", "full", "1/2", "1/3")  # "all": every layer (the paper's §3.1); "full": all but layer 0


def estimate(arch: Arch, variant: Variant, seq_length: int | None = None, batch: int = 1) -> dict:
    """Everything but the megatron parameter count, as a JSON-ready dict (fractions as floats)."""
    L = seq_length or arch.seq_length or DEFAULT_SEQ_LENGTH
    d, d_ff = arch.hidden_size, arch.ffn_hidden_size
    dense_train = training_flops(arch, L, DENSE, batch)
    var_train = training_flops(arch, L, variant, batch)
    plans = {}
    if variant.variant != "dense":
        for ratio in PLAN_RATIOS:
            v = replace(variant, ratio=ratio, layers=None)
            plans[ratio] = {"replaced_layers": len(v.replaced(arch.num_layers)),
                            "saving_fraction": float(exact_saving_fraction(arch, L, v))}
    paper = paper_saving_fraction(d, d_ff, L)
    return {
        "model": arch.name,
        "source": arch.source,
        "architecture": {k: v for k, v in asdict(arch).items() if k not in ("name", "source")},
        "seq_length": L,
        "batch": batch,
        "variant": variant.label,
        "replaced_layers": variant.replaced(arch.num_layers),
        "table1_per_layer": table1(d, d_ff, L, batch, arch.vocab_size),
        "paper_saving_fraction": float(paper),
        "paper_saving_percent": round(100 * float(paper), 1),
        "exact": {
            "unit": "matmul FLOPs per batch (2 per multiply-accumulate); training = 3 x forward",
            "layer_saving_fraction": float(exact_layer_saving_fraction(arch, L)),
            "dense": {"forward": forward_flops(arch, L, DENSE, batch), "training": dense_train},
            variant.label: {"forward": forward_flops(arch, L, variant, batch), "training": var_train},
            "saving_fraction": float(Fraction(dense_train["total"] - var_train["total"], dense_train["total"])),
            "plans": plans,
            "training_flops_per_token": {"dense": dense_train["total"] / (batch * L),
                                         variant.label: var_train["total"] / (batch * L)},
        },
        "parameters": {
            "analytic": {"dense": analytic_parameters(arch, DENSE),
                         variant.label: analytic_parameters(arch, variant)},
        },
    }


def _pct(x: float, digits: int = 1) -> str:
    return f"{100 * x:.{digits}f}%"


def print_report(rep: dict) -> None:
    """One ``estimate`` (plus any megatron counts) as the text block ``stem-flops`` prints per model."""
    a = rep["architecture"]
    print(f"== {rep['model']}" + (f"  ({rep['source']})" if rep["source"] else ""))
    print(f"   d={a['hidden_size']} d_ff={a['ffn_hidden_size']} layers={a['num_layers']} "
          f"heads={a['num_attention_heads']} kv_heads={a['num_kv_heads']} head_dim={a['head_dim']} "
          f"V={a['vocab_size']}   L={rep['seq_length']} B={rep['batch']}")
    t = rep["table1_per_layer"]
    p, m, c = t["prefill_training_flops"], t["decoding_parameter_loading"], t["communication"]
    print("   Table 1, per FFN layer (multiply-accumulates)       FFN             STEM          saving")
    print(f"     prefill/training  B(3|2 d_ff d L + d_ff L)  {p['ffn']:>15,} {p['stem']:>15,} {p['saving']:>15,}"
          f"  (= B d d_ff L)")
    print(f"     decoding param loading  3|2 d d_ff          {m['ffn']:>15,} {m['stem']:>15,} {m['saving']:>15,}")
    print(f"     communication (train)   0 | uniq(BL) d_ff   (<= {c['prefill_training']['stem_upper_bound']:,} values; "
          f"x2 in training)")
    print(f"     communication (decode)  0 | B_uniq d_ff     (<= {c['decoding']['stem_upper_bound']:,} values)")
    e = rep["exact"]
    print(f"   §3.1 saving fraction d_ff/(4d+2L+3d_ff):        {_pct(rep['paper_saving_fraction'], 2)}")
    print(f"   exact, one layer (GQA q/k/v widths, no LM head): {_pct(e['layer_saving_fraction'], 2)}")
    label = rep["variant"]
    if label != "dense":
        print(f"   exact whole-model matmul FLOPs per batch, training (3 x forward), {label} "
              f"({len(rep['replaced_layers'])}/{a['num_layers']} layers replaced):")
        print(f"     {'':24}{'dense':>20}{label:>24}")
        for k in ("attention_projections", "attention_core", "ffn", "lm_head", "total"):
            print(f"     {k:24}{e['dense']['training'][k]:>20,}{e[label]['training'][k]:>24,}")
        print(f"     saving fraction: {_pct(e['saving_fraction'], 2)};  by plan: " + ", ".join(
            f"{r} ({v['replaced_layers']} layers) {_pct(v['saving_fraction'], 2)}" for r, v in e["plans"].items()))
    else:
        print(f"   exact training matmul FLOPs per batch: {e['dense']['training']['total']:,}")
    for kind, counts in rep["parameters"].items():
        for name, pc in counts.items():
            extra = ""
            if kind == "analytic":
                extra = f"  [{'tied' if pc['tied_embeddings'] else 'untied'} embeddings" + \
                        (", q/k/v biases]" if pc["qkv_bias"] else "]")
            print(f"   params {kind + ':':<10}{name:>16}: total {pc['total']:>15,}  active {pc['active']:>14,}"
                  f"  tables {pc['tables']:>15,}{extra}")


def print_summary(reports: list[dict]) -> None:
    """One line per model, to compare the saving fractions across a glob of presets."""
    label = reports[0]["variant"]
    print("\nSummary (saving fraction of training matmul FLOPs)")
    head = f"{'model':<16}{'L':>6}{'§3.1 formula':>14}{'exact layer':>13}{'exact all':>11}"
    if label != "dense":
        head += f"{'exact ' + label:>22}"
    print(head)
    for rep in reports:
        e = rep["exact"]
        line = (f"{rep['model']:<16}{rep['seq_length']:>6}{_pct(rep['paper_saving_fraction'], 2):>14}"
                f"{_pct(e['layer_saving_fraction'], 2):>13}")
        line += f"{_pct(e['plans']['all']['saving_fraction'], 2) if e['plans'] else '-':>11}"
        if label != "dense":
            line += f"{_pct(e['saving_fraction'], 2):>22}"
        print(line)
