"""Builds megatron-core's GPTModel for a run config: TransformerConfig + per-layer specs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from stem_megatron.config import HashMoEConfig, ModelConfig, ParallelConfig, STEMConfig
from stem_megatron.layer_plan import planned_layers
from stem_megatron.model.hash_moe import expert_map, hash_moe_spec
from stem_megatron.model.specs import decoder_block_spec, device_rows, stem_mlp_spec
from stem_megatron.parallel import have_transformer_engine


def transformer_config(
    model: ModelConfig,
    parallel: ParallelConfig,
    on_gpu: bool,
    use_cpu_initialization: bool | None = None,
    stem: STEMConfig | None = None,
    hash_moe: HashMoEConfig | None = None,
) -> TransformerConfig:
    """Llama-style block (RMSNorm, SwiGLU, RoPE, no biases but Qwen2's q/k/v ones); bf16 on GPU, fp32 on CPU.

    Fusions that need CUDA kernels are off on CPU. ``use_cpu_initialization`` makes the initial
    weights independent of the TP layout (the full matrix is drawn, then sliced). For the Hash-MoE
    variant the MoE fields are set from ``hash_moe`` (None: its defaults): top-1, no aux loss, all-to-all
    dispatcher, MoE only on the planned layers (``moe_layer_freq`` pattern), experts not tensor-parallel.
    """
    dtype = torch.bfloat16 if on_gpu else torch.float32
    moe = {}
    if stem is not None and stem.variant == "hash_moe":
        hash_moe = hash_moe or HashMoEConfig()
        planned = set(planned_layers(model.num_layers, stem))
        moe = dict(
            num_moe_experts=hash_moe.num_experts,
            moe_ffn_hidden_size=hash_moe.expert_ffn_hidden_size or model.ffn_hidden_size,
            moe_layer_freq=[int(i in planned) for i in range(model.num_layers)],
            moe_router_topk=1,
            moe_router_pre_softmax=True,  # required by megatron for top-1; unused by the hash router
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=on_gpu and have_transformer_engine(),  # TE grouped GEMM; else SequentialMLP
            expert_model_parallel_size=parallel.expert_model_parallel_size,
            expert_tensor_parallel_size=1,
        )
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.hidden_size // model.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        sequence_parallel=parallel.sequence_parallel and parallel.tensor_model_parallel_size > 1,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=on_gpu,
        use_cpu_initialization=(not on_gpu) if use_cpu_initialization is None else use_cpu_initialization,
        bias_activation_fusion=on_gpu,
        bias_dropout_fusion=on_gpu,
        # megatron's fused softmax kernel (scaled_masked_softmax_cuda) ships with no installed package; TE's
        # attention (GPU with TE) does not use it, megatron's local attention then takes torch's softmax
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        **moe,
    )


def build_gpt(
    model: ModelConfig,
    stem: STEMConfig,
    config: TransformerConfig,
    row_source: ModuleSpec | None = None,
    use_te: bool = False,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    pp_rank: int | None = None,
    attn_mask_type: AttnMaskType = AttnMaskType.causal,
    seed: int = 0,
    hash_moe: HashMoEConfig | None = None,
) -> GPTModel:
    """This rank's GPTModel stage with STEM MLPs on the planned layers; embeddings untied (paper §4.1).

    ``row_source`` is the spec of the module serving ``U_l`` rows (default: a device parameter drawn from
    ``seed``, the run's ``train.seed``, as the host tables are); ``attn_mask_type=arbitrary`` when batches
    carry per-document attention masks; ``hash_moe``: the experts of ``stem.variant=hash_moe`` (None: its
    defaults), as ``transformer_config`` was given.
    """
    if stem.variant == "hash_moe":
        hash_moe = hash_moe or HashMoEConfig()
        expert_of_token = expert_map(model.vocab_size, hash_moe.num_experts, hash_moe.hash_map, hash_moe.hash_seed)
        mlp = hash_moe_spec(expert_of_token, hash_moe.num_experts, use_te, grouped_gemm=config.moe_grouped_gemm)
    else:
        rows = row_source or device_rows(stem.table_init, stem.table_init_std, seed)
        mlp = stem_mlp_spec(stem.variant, model.vocab_size, rows, use_te)
    spec = decoder_block_spec(config, planned_layers(model.num_layers, stem), mlp, use_te, pp_rank, attn_mask_type)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=model.vocab_size,
        max_sequence_length=model.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=model.rotary_base,
        rope_scaling=model.rope_scaling_factor is not None,
        rope_scaling_factor=model.rope_scaling_factor or 8.0,  # megatron's default where unused
    )
    return in_params_dtype(gpt, config.params_dtype)


def in_params_dtype(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Every parameter of ``module`` in ``dtype``, as megatron's ``Float16Module`` makes a bf16 model: megatron's torch
    RMSNorm (the local spec, no TE) takes no dtype and would keep an fp32 weight, on which torch's fused RMSNorm
    refuses a bf16 input (a warning at every step, the unfused path). Megatron's optimizer keeps fp32 master copies."""
    for param in module.parameters():
        if param.dtype != dtype:
            param.data = param.data.to(dtype)
    return module
