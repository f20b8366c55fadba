"""Hash layers (Roller et al., 2021) as a megatron-core MoE router: the paper's Hash-MoE baseline.

A fixed token-id -> expert map, top-1, no learned router and no auxiliary loss (paper eq. 3:
``y = f_hash(t)(x)``). ``HashRouter`` plugs into megatron-core's ``MoELayer`` through
``MoESubmodules.router``; experts, expert parallelism and the all-to-all token dispatcher are
megatron's. Two maps: a seeded random balanced hash (equal vocabulary share per expert) and a
frequency-balanced one from token counts (experts get similar token mass).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from stem_megatron.model.token_context import current_token_ids


def random_balanced_map(vocab_size: int, num_experts: int, seed: int) -> torch.Tensor:
    """Expert of each token id: a seeded permutation dealt round-robin (sizes differ by at most 1)."""
    perm = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
    expert = torch.empty(vocab_size, dtype=torch.int64)
    expert[perm] = torch.arange(vocab_size) % num_experts
    return expert


def frequency_balanced_map(counts: np.ndarray, num_experts: int) -> torch.Tensor:
    """Greedy longest-processing-time assignment: most frequent ids first, each to the expert with
    the least token mass so far (ties: fewest ids), so every expert sees a similar number of tokens."""
    mass = np.zeros(num_experts)
    size = np.zeros(num_experts, dtype=np.int64)
    expert = np.empty(len(counts), dtype=np.int64)
    for token in np.argsort(-counts, kind="stable"):
        e = int(np.lexsort((size, mass))[0])
        expert[token] = e
        mass[e] += counts[token]
        size[e] += 1
    return torch.from_numpy(expert)


def expert_map(vocab_size: int, num_experts: int, hash_map: str, seed: int) -> torch.Tensor:
    """``hash_map``: "random" or "frequency:<token counts .npy of length V>"."""
    if hash_map == "random":
        return random_balanced_map(vocab_size, num_experts, seed)
    if hash_map.startswith("frequency:"):
        counts = np.load(hash_map.split(":", 1)[1])
        if counts.shape != (vocab_size,):
            raise ValueError(f"token counts {hash_map} have shape {counts.shape}, expected ({vocab_size},)")
        return frequency_balanced_map(counts, num_experts)
    raise ValueError(f"hash_moe.hash_map {hash_map!r} is not 'random' or 'frequency:<counts.npy>'")


class HashRouter(MegatronModule):
    """Routes each token to ``expert_of_token[t]`` with probability 1 (top-1, nothing learned).

    Also counts the step's tokens per expert and the tokens that leave this rank's experts (the
    all-to-all traffic), for the per-step metrics.
    """

    def __init__(self, config: TransformerConfig, pg_collection=None, is_mtp_layer: bool = False, *,
                 expert_of_token: torch.Tensor):
        """``pg_collection`` and ``is_mtp_layer`` are what megatron's ``MoELayer`` passes every router; the map
        needs neither (expert parallelism is read from megatron's parallel state)."""
        super().__init__(config=config)
        self.num_experts = config.num_moe_experts
        self.register_buffer("expert_of_token", expert_of_token.clone(), persistent=False)
        self.layer_number: Optional[int] = None
        ep = parallel_state.get_expert_model_parallel_world_size()
        self._local = range(parallel_state.get_expert_model_parallel_rank() * self.num_experts // ep,
                            (parallel_state.get_expert_model_parallel_rank() + 1) * self.num_experts // ep)
        # counters stay on the device until the step's end (take_stats): no sync per MoE layer and forward
        self.register_buffer("tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("tokens_sent", torch.zeros((), dtype=torch.int64), persistent=False)

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    def forward(self, input: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """input [s, b, h] -> (probs, routing_map), both [s*b, num_experts] in megatron's token order.

        With sequence parallelism the input holds this TP rank's chunk of the sequence."""
        tokens = current_token_ids().t()
        if self.config.sequence_parallel:
            tokens = tokens.chunk(parallel_state.get_tensor_model_parallel_world_size())[
                parallel_state.get_tensor_model_parallel_rank()]
        experts = self.expert_of_token[tokens.reshape(-1)].to(input.device)
        routing_map = torch.zeros(experts.numel(), self.num_experts, dtype=torch.bool, device=experts.device)
        routing_map.scatter_(1, experts[:, None], True)  # one_hot would check the ids on the host (a sync)
        if padding_mask is not None:
            routing_map &= padding_mask.reshape(-1, 1)
        probs = routing_map.float()
        if torch.is_grad_enabled():
            self.tokens_per_expert += routing_map.sum(0)
            self.tokens_sent += ((experts < self._local.start) | (experts >= self._local.stop)).sum()
        return probs, routing_map

    def take_stats(self) -> tuple[torch.Tensor, int]:
        stats = (self.tokens_per_expert.cpu(), int(self.tokens_sent))
        self.tokens_per_expert.zero_()
        self.tokens_sent.zero_()
        return stats


def take_moe_stats(model: torch.nn.Module) -> dict:
    """This rank's Hash-MoE counters since the last call: tokens per expert (its micro-batches, all
    MoE layers), max/mean expert load, and bytes its all-to-alls sent to other expert-parallel ranks
    in training (dispatch + combine forward, and the same two again in backward). Empty for models
    without Hash-MoE layers."""
    routers = [m for m in model.modules() if isinstance(m, HashRouter)]
    if not routers:
        return {}
    load, sent = torch.zeros(routers[0].num_experts, dtype=torch.int64), 0
    for router in routers:
        tokens, out = router.take_stats()
        load += tokens
        sent += out
    element = routers[0].config.params_dtype.itemsize
    return {"moe_tokens_per_expert": load.tolist(),
            "moe_load_max_over_mean": float(load.max() / load.float().mean()) if load.sum() else None,
            "moe_all_to_all_bytes": 4 * sent * routers[0].config.hidden_size * element}


def hash_moe_spec(expert_of_token: torch.Tensor, num_experts: int, use_te: bool, grouped_gemm: bool) -> partial:
    """megatron's MoE layer builder (experts, dispatcher) with the hash router in place of TopKRouter: megatron-core
    0.19 gives the builder as ``partial(MoELayer, submodules=MoESubmodules(...))``."""
    moe = get_moe_module_spec(use_te=use_te, num_experts=num_experts, moe_grouped_gemm=grouped_gemm)
    router = partial(HashRouter, expert_of_token=expert_of_token)
    return partial(moe.func, *moe.args,
                   **{**moe.keywords, "submodules": dataclasses.replace(moe.keywords["submodules"], router=router)})
