"""torchtitan's DeepSeek-V3 at our DeepSeek shape, for ``gptoughts bench --model deepseek --compare torchtitan``.

The config is built with torchtitan's own layer builder (``build_mla_moe_layers``: MLA + its MoE with
``TokenChoiceTopKRouter``, ``GroupedExperts`` and shared experts) and inits, as its flavours (``_16b``...) are, with
our widths, layer split, heads, MLA ranks and head dims, experts, top-k, score function, groups and route
scale/norm; its sharding declarations are set as its trainer's ``update_from_config`` sets them (EP 1).
``bench_torchtitan`` parallelizes it with ``parallelize_deepseekv3`` and registers the MoE load-balancing hook its
trainer registers (``post_optimizer_build_fn``). What torchtitan has no equivalent for is refused in one line,
except our sequence-wise balance loss, which the compare turns off on our side (see :func:`align_ours`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from gptoughts.errors import ConfigError, UserError

SEQ_AUX_NOTE = "model.seq_aux_loss_coef 0 (torchtitan's DeepSeek-V3 has no sequence-wise balance loss)"

_DS: SimpleNamespace | None = None


def import_torchtitan_deepseek() -> SimpleNamespace:
    """Its DeepSeek-V3 pieces, imported once, after ``import_torchtitan`` (whose torch shims its MTP module needs
    at import: ``DataParallelMeshDims``)."""
    global _DS
    if _DS is not None:
        return _DS
    try:
        import torchtitan.models.deepseek_v3 as deepseek_v3
        from torchtitan.components.optimizer import register_moe_load_balancing_hook
        from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config
    except Exception as e:  # an API of this torch it expects, or a module of another torchtitan version
        raise UserError(
            f"torchtitan's DeepSeek-V3 does not load: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    _DS = SimpleNamespace(
        D=deepseek_v3,
        parallelize=deepseek_v3.parallelize_deepseekv3,
        register_moe_load_balancing_hook=register_moe_load_balancing_hook,
        set_sharding=set_deepseek_v3_sharding_config,
    )
    return _DS


def align_ours(overrides: dict[str, Any], args: Any) -> tuple[dict[str, Any], list[str]]:
    """Our model overrides for the compare, and what they change: the sequence-wise balance loss (on by default,
    ``seq_aux_loss_coef``) off, since torchtitan's MoE has none; the same model is then timed on both sides."""
    if args.seq_aux_loss_coef > 0:
        return {**overrides, "seq_aux_loss_coef": 0.0}, [SEQ_AUX_NOTE]
    return overrides, []


def check_torchtitan_deepseek_shape(args: Any) -> None:
    """Our options its DeepSeek-V3 (with its chunked loss) has no equivalent for: one line, and how to compare."""
    refused = {
        "mtp_depth": (
            args.mtp_depth > 0,
            "its chunked loss takes no MTP outputs (its MTPLoss is another step); compare with --model.mtp_depth 0",
        ),
        "seq_aux_loss_coef": (
            args.seq_aux_loss_coef > 0,
            "it has no sequence-wise balance loss; compare with --model.seq_aux_loss_coef 0",
        ),
    }
    for name, (on, why) in refused.items():
        if on:
            raise ConfigError(
                f"--compare torchtitan: torchtitan's DeepSeek-V3 has no equivalent of model.{name} = "
                f"{getattr(args, name)!r}: {why}"
            )


def torchtitan_deepseek_config(tt: SimpleNamespace, args: Any, block_size: int, *, attention: str) -> Any:
    """torchtitan's ``DeepSeekV3Model.Config`` at our shape (see the module docstring); ``attention`` ``sdpa``
    puts its ``ScaledDotProductAttention`` in place of FlexAttention, as for Llama 3."""
    check_torchtitan_deepseek_shape(args)
    ds = import_torchtitan_deepseek()
    D, d, v = ds.D, args.d_model, args.vocab_size
    groups = args.n_expert_groups > 1  # ours: 1/1 is no group limit; its: None
    layers = D.build_mla_moe_layers(
        n_layers=args.n_layers,
        n_dense_layers=args.n_dense_layers,
        dim=d,
        n_heads=args.n_heads,
        q_lora_rank=args.q_lora_rank or 0,  # ours None, its 0: one full wq
        kv_lora_rank=args.kv_lora_rank,
        qk_nope_head_dim=args.qk_nope_head_dim,
        qk_rope_head_dim=args.qk_rope_head_dim,
        v_head_dim=args.v_head_dim,
        mscale=1.0,
        dense_hidden_dim=args.dense_inter_dim,
        moe_hidden_dim=args.moe_inter_dim,
        num_experts=args.n_routed_experts,
        num_shared_experts=args.n_shared_experts,
        router_top_k=args.n_activated_experts,
        router_score_func=args.score_func,
        router_num_expert_groups=args.n_expert_groups if groups else None,
        router_num_limited_groups=args.n_limited_groups if groups else None,
        router_route_scale=args.route_scale,
        router_route_norm=args.norm_topk_prob,
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        linear_init=D._LINEAR_INIT,
        norm_init=D._NORM_INIT,
        depth_init=D._depth_init,
        depth_experts_init=D._depth_experts_init,
        # RoPE tables sized to the run; rope scaling (yarn's table and softmax mscale) changes values, not the step
        rope=tt.ComplexRoPE.Config(dim=args.qk_rope_head_dim, max_seq_len=block_size, theta=args.rope_theta),
    )
    for layer in layers:
        _match_layer(tt, layer, args, attention)
    cfg = D.DeepSeekV3Model.Config(
        dim=d,
        vocab_size=v,
        enable_weight_tying=bool(args.tie_embeddings),
        tok_embeddings=tt.Embedding.Config(num_embeddings=v, embedding_dim=d, param_init=D._EMBEDDING_INIT),
        norm=tt.RMSNorm.Config(normalized_shape=d, eps=args.norm_eps, param_init=D._NORM_INIT),
        lm_head=tt.Linear.Config(in_features=d, out_features=v, param_init=D._output_linear_init(d)),
        layers=layers,
    )
    ds.set_sharding(cfg, enable_sp=tt.ParallelismConfig().enable_sequence_parallel, enable_ep=False)
    return cfg


def _match_layer(tt: SimpleNamespace, layer: Any, args: Any, attention: str) -> None:
    """One layer's config brought to ours where its builder has no argument: norm epsilons (ours: ``norm_eps`` for
    the block norms, 1e-6 for the latent norms; its default 1e-5), no shared experts, no bias balancing."""
    layer.attention_norm.eps = layer.ffn_norm.eps = args.norm_eps
    layer.attention.kv_norm.eps = layer.attention.q_norm.eps = 1e-6
    if attention == "sdpa":
        layer.attention.inner_attention = tt.ScaledDotProductAttention.Config()
    if layer.moe is not None:
        if args.n_shared_experts == 0:
            layer.moe.shared_experts = None
        # its aux-loss-free balancing: the bias step per optimizer step (ours: bias_update_rate), None for off
        layer.moe.load_balance_coeff = args.bias_update_rate or None
