"""Angular spread of STEM rows vs dense up-projection outputs (paper §5.1, Fig. 4).

    .venv/bin/python tools/angular_spread.py --export STEM_EXPORT [--dense-export DENSE_EXPORT] \
        [--data data_cache/python-doc/valid] [--num-tokens 512] [--windows 16] --out-dir runs/angular

Token sample: the ``--num-tokens`` most frequent ids of the first ``--windows`` ``seq_length``-token
windows of ``--data`` (an indexed dataset prefix), or of seeded random-id windows without ``--data``.
The windows are run through the model(s); a forward pre-hook on every layer's MLP records the MLP
input (the normalised hidden state ``x``) at each sampled id's first occurrence. Per group of vectors,
the distribution of pairwise cosine similarities (upper triangle, unit-normalised vectors):

* ``stem_rows/layer<i>``        the STEM table rows ``U_l[t]`` of every STEM layer (Fig. 4a);
* ``stem_gated/layer<i>``       ``SiLU(W_g x) * U_l[t]`` (variant ``stem``: the down projection's input, Fig. 4c);
* ``up_proj/layer<i>``          ``W_u x`` of this export's dense SwiGLU layers (e.g. layer 0 of ratio ``full``);
* ``dense_up_proj/layer<i>``    ``W_u x`` of ``--dense-export``'s layers on the same windows (Fig. 4b);
* ``dense_gated/layer<i>``      ``SiLU(W_g x) * W_u x`` of the dense export (Fig. 4c's comparison).

Writes ``angular_spread.json`` (per group: mean, std, mean |cos|, min/max, quantiles, a 100-bin
histogram on [-1, 1]) and ``angular_spread.png`` (histograms: STEM rows per layer; STEM vs up-projection).
Runs megatron in this process (a world-of-one gloo group).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's stem_megatron, installed or not
from stem_megatron.setup_check import require_environment, require_extra  # noqa: E402

require_environment()  # before torch and megatron: another Python gets `make setup`, not a traceback
require_extra("plots")  # every run ends in its figure: say so before the work

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

QUANTILES = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)
BINS = 100


def sample_windows(model, data: Optional[str], windows: int, seed: int) -> torch.Tensor:
    """``[windows, seq_length]`` token ids: from the indexed dataset, else seeded random decodable ids."""
    S = model.seq_length
    if data:
        from stem_megatron.eval.perplexity import token_windows

        rows = []
        for w in token_windows(data, S - 1):  # S-token windows
            rows.append(torch.from_numpy(w.copy()))
            if len(rows) == windows:
                break
        if not rows:
            raise ValueError(f"{data} has fewer than {S} tokens")
        return torch.stack(rows)
    return torch.randint(0, model.decodable_ids, (windows, S), generator=torch.Generator().manual_seed(seed))


def chosen_ids(windows: torch.Tensor, n: int) -> list[int]:
    ids, counts = torch.unique(windows, return_counts=True)
    order = torch.argsort(counts, descending=True, stable=True)
    return ids[order[:n]].tolist()


@torch.no_grad()
def mlp_inputs(model, windows: torch.Tensor, ids: list[int]) -> dict[int, torch.Tensor]:
    """``{0-based layer: [len(ids), h]}``: each id's MLP input at its first occurrence in ``windows``."""
    flat = windows.reshape(-1)
    first = torch.tensor([int((flat == t).nonzero()[0]) for t in ids])
    b, s = first // windows.shape[1], first % windows.shape[1]
    captured: dict[int, list[torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(model.model.decoder.layers):
        def hook(_module, args, i=i):
            captured.setdefault(i, []).append(args[0].detach().float().cpu())  # [s, b, h]
        hooks.append(layer.mlp.register_forward_pre_hook(hook))
    try:
        for start in range(0, windows.shape[0], 4):
            model.logits(windows[start:start + 4])
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for i, parts in captured.items():
        x = torch.cat(parts, dim=1)  # [s, B, h]
        out[i] = x[s, b]
    return out


def mlp_vectors(model, inputs: dict[int, torch.Tensor], ids: list[int], prefix: str) -> dict[str, torch.Tensor]:
    """The address vectors of every layer of ``model`` for ``ids`` (module doc's groups)."""
    vectors = {}
    d_ff = model.config.model.ffn_hidden_size
    idx = torch.tensor(ids)
    for i, layer in enumerate(model.model.decoder.layers):
        mlp, x = layer.mlp, inputs[i]
        if hasattr(mlp, "U_l"):
            rows = mlp.U_l.weight.detach().float().cpu()[idx]
            vectors[f"stem_rows/layer{i}"] = rows
            if getattr(mlp, "variant", None) == "stem":
                gate = x @ mlp.W_g.weight.detach().float().cpu().t()
                vectors[f"stem_gated/layer{i}"] = F.silu(gate) * rows
        elif hasattr(mlp, "linear_fc1"):
            w = mlp.linear_fc1.weight.detach().float().cpu()
            if w.shape[0] != 2 * d_ff:
                continue  # not a gated (SwiGLU) fc1
            up = x @ w[d_ff:].t()  # megatron's glu: act(first half) * second half
            vectors[f"{prefix}up_proj/layer{i}"] = up
            vectors[f"{prefix}gated/layer{i}" if prefix else f"up_gated/layer{i}"] = F.silu(x @ w[:d_ff].t()) * up
    return vectors


def cosine_stats(v: torch.Tensor) -> dict:
    u = F.normalize(v.double(), dim=-1)
    cos = (u @ u.t())
    iu = torch.triu_indices(len(v), len(v), offset=1)
    c = cos[iu[0], iu[1]].clamp(-1, 1).numpy()
    hist, edges = np.histogram(c, bins=BINS, range=(-1.0, 1.0))
    return {"pairs": int(c.size), "dim": int(v.shape[1]), "mean": float(c.mean()), "std": float(c.std()),
            "mean_abs": float(np.abs(c).mean()), "min": float(c.min()), "max": float(c.max()),
            "quantiles": {str(q): float(np.quantile(c, q)) for q in QUANTILES},
            "mean_angle_deg": float(np.degrees(np.arccos(c)).mean()),
            "histogram": {"counts": hist.tolist(), "edges": [float(edges[0]), float(edges[-1])]}}, c


def plot(values: dict[str, np.ndarray], path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    bins = np.linspace(-1, 1, BINS + 1)
    for name, c in values.items():
        if name.startswith("stem_rows/"):
            a.hist(c, bins=bins, histtype="step", density=True, label=name.split("/")[1])
    a.set(title="(a) STEM rows, per layer", xlabel="pairwise cosine similarity", ylabel="density")
    a.legend(fontsize=7)
    for name, c in values.items():
        kind = name.split("/")[0]
        if kind in ("stem_rows", "up_proj", "dense_up_proj"):
            b.hist(c, bins=bins, histtype="step", density=True, label=name)
    b.set(title="(b) STEM rows vs up-projection outputs W_u x", xlabel="pairwise cosine similarity")
    b.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def angular_spread(export, dense_export=None, data=None, num_tokens: int = 512, windows: int = 16,
                   seed: int = 0, out_dir=".") -> dict:
    from stem_megatron.inference.model import InferenceModel

    model = InferenceModel(export, device="cpu")
    toks = sample_windows(model, data, windows, seed)
    ids = chosen_ids(toks, num_tokens)
    if len(ids) < 2:
        raise ValueError("fewer than two distinct tokens sampled: raise --windows")
    vectors = mlp_vectors(model, mlp_inputs(model, toks, ids), ids, "")
    if dense_export:
        dense = InferenceModel(dense_export, device="cpu")
        if dense.vocab_size != model.vocab_size:
            raise ValueError(f"{dense_export} has vocab {dense.vocab_size}, {export} has {model.vocab_size}: "
                             "compare models trained with the same tokenizer")
        vectors.update(mlp_vectors(dense, mlp_inputs(dense, toks, ids), ids, "dense_"))
    if not any(k.startswith("stem_rows/") for k in vectors):
        raise ValueError(f"{export} has no STEM tables (decoder.layers.<i>.mlp.U_l.weight)")
    groups, values = {}, {}
    for name, v in vectors.items():
        groups[name], values[name] = cosine_stats(v)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {"export": str(export), "dense_export": str(dense_export) if dense_export else None,
              "data": str(data) if data else None, "token_sample": "most frequent in " + (
                  f"{windows} windows of {data}" if data else f"{windows} random-id windows (seed {seed})"),
              "num_tokens": len(ids), "token_ids": ids, "groups": groups}
    result["plot"] = str(plot(values, out / "angular_spread.png"))
    (out / "angular_spread.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--export", required=True, help="STEM export directory")
    p.add_argument("--dense-export", help="dense export on the same tokenizer, for Fig. 4b's comparison")
    p.add_argument("--data", help="indexed dataset prefix for the token sample and the hidden inputs")
    p.add_argument("--num-tokens", type=int, default=512)
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=".")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    result = angular_spread(args.export, args.dense_export, args.data, args.num_tokens, args.windows, args.seed,
                            args.out_dir)
    for name, g in result["groups"].items():
        print(f"{name:28s} pairs={g['pairs']:8d}  mean cos={g['mean']:+.4f}  std={g['std']:.4f}  "
              f"mean|cos|={g['mean_abs']:.4f}  q05..q95=[{g['quantiles']['0.05']:+.3f}, {g['quantiles']['0.95']:+.3f}]")
    print(f"wrote {Path(args.out_dir) / 'angular_spread.json'} and {result['plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
