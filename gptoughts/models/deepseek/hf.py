"""Hugging Face interop of DeepSeek (``DeepseekV3ForCausalLM``): config both ways and state-dict mapping.

Module names map 1:1 onto ``DeepseekV3ForCausalLM`` (see ``from_hf`` / ``to_hf``):

| ours | transformers |
| --- | --- |
| ``tok_embeddings`` / ``norm`` / ``output`` | ``model.embed_tokens`` / ``model.norm`` / ``lm_head`` |
| ``layers.{i}.attention_norm`` / ``ffn_norm`` | ``model.layers.{i}.input_layernorm`` / ``post_attention_layernorm`` |
| ``layers.{i}.attention.wq`` (or ``wq_a``, ``q_norm``, ``wq_b``) | ``self_attn.q_proj`` (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``) |
| ``layers.{i}.attention.{wkv_a,kv_norm,wkv_b,wo}`` | ``self_attn.{kv_a_proj_with_mqa,kv_a_layernorm,kv_b_proj,o_proj}`` |
| ``layers.{i}.feed_forward.{w1,w3,w2}`` (dense layers) | ``mlp.{gate,up,down}_proj`` |
| ``layers.{i}.feed_forward.gate`` / ``expert_bias`` | ``mlp.gate.weight`` / ``mlp.gate.e_score_correction_bias`` |
| ``layers.{i}.feed_forward.experts.{w1,w3,w2}[e]`` | ``mlp.experts.{e}.{gate,up,down}_proj`` |
| ``layers.{i}.feed_forward.shared_experts.{w1,w3,w2}`` | ``mlp.shared_experts.{gate,up,down}_proj`` |
| ``mtp.{enorm,hnorm,eh_proj,norm}``, ``mtp.block.*`` | ``model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.norm}``, ``model.layers.{L}.*`` |

RoPE: DeepSeek checkpoints lay the rotary dims out in interleaved pairs (``rope_interleave = true``). We
compute in the rotate_half layout shared with Llama (``layers.apply_rotary``) and permute the rope rows of
``wq``/``wq_b``/``wkv_a`` on import and back on export: the rotated values, hence the scores, are the same.
Rope scaling: ``linear``, ``llama3`` and DeepSeek's ``yarn`` (including its ``mscale_all_dim`` softmax scale).
"""

from __future__ import annotations

from typing import Any

import torch

from gptoughts.errors import ConfigError, UserError
from gptoughts.models.deepseek.args import DeepSeekArgs
from gptoughts.models.deepseek.rope import rope_kind
from gptoughts.models.hf import UnsupportedHFConfig

__all__ = ["HF_MODEL_TYPES", "args_from_hf", "from_hf", "hf_config", "to_hf"]

HF_MODEL_TYPES = ("deepseek_v3",)


def args_from_hf(config: dict[str, Any]) -> DeepSeekArgs:
    """``DeepSeekArgs`` from a (resolved) ``DeepseekV3`` ``config.json`` dict (transformers 4 or 5 rope keys).

    The router is sigmoid (what ``DeepseekV3ForCausalLM`` computes, whatever ``scoring_func`` says).
    ``mtp_depth`` is 0: MTP is a training aid; set ``model.mtp_depth = 1`` to train one (``from_hf`` then maps
    the checkpoint's ``model.layers.{n_layers}.*`` MTP weights when present). Raises ``UnsupportedHFConfig`` for
    what the native code would not reproduce exactly (the loader then falls back to transformers' own code).
    """
    if config.get("model_type") not in HF_MODEL_TYPES:
        raise UnsupportedHFConfig(f"model_type {config.get('model_type')!r}")
    if config.get("attention_bias"):
        raise UnsupportedHFConfig("attention_bias")
    if config.get("hidden_act", "silu") not in ("silu", "swish"):
        raise UnsupportedHFConfig(f"activation {config.get('hidden_act')!r}")
    rope = dict(config.get("rope_parameters") or {})
    theta = float(rope.pop("rope_theta", config.get("rope_theta", 10000.0)))
    if not rope and config.get("rope_scaling"):
        rope = dict(config["rope_scaling"])
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    if float(rope.pop("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedHFConfig("partial rotary embeddings")
    scaling = None if kind == "default" else {"type": kind, **rope}
    if kind not in ("default", "linear", "llama3", "yarn"):
        raise UnsupportedHFConfig(f"rope type {kind!r}")
    n_heads = int(config["num_attention_heads"])
    if int(config.get("num_key_value_heads") or n_heads) != n_heads:
        raise UnsupportedHFConfig("num_key_value_heads != num_attention_heads")
    return DeepSeekArgs(
        d_model=int(config["hidden_size"]),
        n_layers=int(config["num_hidden_layers"]),
        n_heads=n_heads,
        vocab_size=int(config["vocab_size"]),
        max_seq_len=int(config.get("max_position_embeddings", 4096)),
        q_lora_rank=config.get("q_lora_rank"),
        kv_lora_rank=int(config["kv_lora_rank"]),
        qk_nope_head_dim=int(config["qk_nope_head_dim"]),
        qk_rope_head_dim=int(config["qk_rope_head_dim"]),
        v_head_dim=int(config["v_head_dim"]),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        n_routed_experts=int(config["n_routed_experts"]),
        n_shared_experts=int(config.get("n_shared_experts") or 0),
        n_activated_experts=int(config["num_experts_per_tok"]),
        moe_inter_dim=int(config["moe_intermediate_size"]),
        dense_inter_dim=int(config["intermediate_size"]),
        n_dense_layers=min(int(config.get("first_k_dense_replace") or 0), int(config["num_hidden_layers"])),
        score_func="sigmoid",
        route_scale=float(config.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        n_expert_groups=int(config.get("n_group") or 1),
        n_limited_groups=int(config.get("topk_group") or 1),
        mtp_depth=0,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        init_std=float(config.get("initializer_range", 0.02)),
        hf_rope_interleave=bool(config.get("rope_interleave", True)),
    )


def hf_config(args: DeepSeekArgs, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``config.json`` dict for ``DeepseekV3ForCausalLM`` (transformers 5 ``rope_parameters`` plus the legacy
    ``rope_theta``/``rope_scaling`` keys that transformers 4, vLLM and SGLang read). ``base``: the config of the
    model the run started from, if any; its other keys (token ids, ...) are kept underneath ours."""
    if args.score_func != "sigmoid":
        raise ConfigError(
            "DeepseekV3ForCausalLM routes with sigmoid scores; a softmax router cannot be exported"
        )
    rope_params: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    legacy_scaling = None
    if args.rope_scaling:
        extra = {k: v for k, v in args.rope_scaling.items() if k not in ("type", "rope_type")}
        rope_params.update(extra, rope_type=rope_kind(args.rope_scaling))
        legacy_scaling = {"type": rope_kind(args.rope_scaling), **extra}
    cfg: dict[str, Any] = dict(base) if base and base.get("model_type") == "deepseek_v3" else {}
    for stale in ("auto_map", "torch_dtype", "dtype", "quantization_config"):
        cfg.pop(stale, None)
    cfg.update(
        {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": args.vocab_size,
            "hidden_size": args.d_model,
            "intermediate_size": args.dense_inter_dim,
            "moe_intermediate_size": args.moe_inter_dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_heads,
            "n_shared_experts": args.n_shared_experts,
            "n_routed_experts": args.n_routed_experts,
            "num_experts_per_tok": args.n_activated_experts,
            "routed_scaling_factor": args.route_scale,
            "norm_topk_prob": args.norm_topk_prob,
            "n_group": args.n_expert_groups,
            "topk_group": args.n_limited_groups,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "first_k_dense_replace": args.n_dense_layers,
            "kv_lora_rank": args.kv_lora_rank,
            "q_lora_rank": args.q_lora_rank,
            "qk_nope_head_dim": args.qk_nope_head_dim,
            "qk_rope_head_dim": args.qk_rope_head_dim,
            "v_head_dim": args.v_head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": args.max_seq_len,
            "rms_norm_eps": args.norm_eps,
            "rope_parameters": rope_params,
            "rope_theta": args.rope_theta,
            "rope_scaling": legacy_scaling,
            "rope_interleave": args.hf_rope_interleave,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": args.tie_embeddings,
            "initializer_range": args.init_std,
            "num_nextn_predict_layers": args.mtp_depth,
            "use_cache": True,
        }
    )
    return cfg


def _rope_perm(rope_dim: int) -> torch.Tensor:
    """Row order taking interleaved rope pairs ``(x0, x1), (x2, x3), ...`` to rotate_half's ``[evens; odds]``."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


def _permute_q(w: torch.Tensor, args: DeepSeekArgs, perm: torch.Tensor) -> torch.Tensor:
    """Reorder the rope rows of each head of a ``[H * (nope + rope), in]`` query weight."""
    heads = w.reshape(-1, args.qk_head_dim, w.size(-1))
    rope = heads[:, args.qk_nope_head_dim :][:, perm]
    return torch.cat([heads[:, : args.qk_nope_head_dim], rope], dim=1).reshape(w.shape)


def _permute_kv_a(w: torch.Tensor, args: DeepSeekArgs, perm: torch.Tensor) -> torch.Tensor:
    """Reorder the rope rows (the last ``qk_rope_head_dim``) of ``wkv_a``."""
    return torch.cat([w[: args.kv_lora_rank], w[args.kv_lora_rank :][perm]], dim=0)


def _layer_names(args: DeepSeekArgs, moe: bool) -> list[tuple[str, str]]:
    """(ours, HF) name suffixes of one decoder layer's tensors, routed experts excepted (stacked per expert)."""
    names = [
        ("attention_norm.weight", "input_layernorm.weight"),
        ("ffn_norm.weight", "post_attention_layernorm.weight"),
        ("attention.wkv_a.weight", "self_attn.kv_a_proj_with_mqa.weight"),
        ("attention.kv_norm.weight", "self_attn.kv_a_layernorm.weight"),
        ("attention.wkv_b.weight", "self_attn.kv_b_proj.weight"),
        ("attention.wo.weight", "self_attn.o_proj.weight"),
    ]
    if args.q_lora_rank is None:
        names.append(("attention.wq.weight", "self_attn.q_proj.weight"))
    else:
        names += [
            ("attention.wq_a.weight", "self_attn.q_a_proj.weight"),
            ("attention.q_norm.weight", "self_attn.q_a_layernorm.weight"),
            ("attention.wq_b.weight", "self_attn.q_b_proj.weight"),
        ]
    if not moe:
        return names + [
            ("feed_forward.w1.weight", "mlp.gate_proj.weight"),
            ("feed_forward.w3.weight", "mlp.up_proj.weight"),
            ("feed_forward.w2.weight", "mlp.down_proj.weight"),
        ]
    names += [
        ("feed_forward.gate.weight", "mlp.gate.weight"),
        ("feed_forward.expert_bias", "mlp.gate.e_score_correction_bias"),
    ]
    if args.n_shared_experts:
        names += [
            ("feed_forward.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"),
            ("feed_forward.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"),
            ("feed_forward.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"),
        ]
    return names


_EXPERT_NAMES = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
_MTP_NAMES = [
    ("mtp.enorm.weight", "enorm.weight"),
    ("mtp.hnorm.weight", "hnorm.weight"),
    ("mtp.eh_proj.weight", "eh_proj.weight"),
    ("mtp.norm.weight", "shared_head.norm.weight"),
]


def _q_weight(args: DeepSeekArgs) -> tuple[str, str]:
    """(ours, HF) suffix of the projection whose rows hold the query rope dims."""
    if args.q_lora_rank is None:
        return "attention.wq.weight", "self_attn.q_proj.weight"
    return "attention.wq_b.weight", "self_attn.q_b_proj.weight"


def _block_plan(args: DeepSeekArgs) -> list[tuple[str, str, bool]]:
    """(our prefix, HF prefix, is MoE) for every block, the MTP block last."""
    plan = [(f"layers.{i}.", f"model.layers.{i}.", i >= args.n_dense_layers) for i in range(args.n_layers)]
    if args.mtp_depth:
        plan.append(("mtp.block.", f"model.layers.{args.n_layers}.", args.n_moe_layers > 0))
    return plan


def from_hf(state_dict: dict[str, torch.Tensor], args: DeepSeekArgs) -> dict[str, torch.Tensor]:
    """A ``DeepseekV3ForCausalLM`` state dict -> ours (for ``args``, e.g. from ``args_from_hf``).

    Accepts the on-disk layout (``mlp.experts.{e}.{gate,up,down}_proj.weight``) and transformers 5's in-memory
    fused one (``mlp.experts.gate_up_proj`` / ``down_proj``). MTP weights at ``model.layers.{n_layers}.*`` are
    mapped when ``args.mtp_depth`` is 1 and dropped otherwise (as are their copies of the embedding and head).
    Raises ``UserError`` on missing or unexpected tensors.
    """
    sd = dict(state_dict)
    out: dict[str, torch.Tensor] = {}
    perm = _rope_perm(args.qk_rope_head_dim) if args.hf_rope_interleave else None

    def take(name: str) -> torch.Tensor:
        if name not in sd:
            raise UserError(f"DeepSeek checkpoint lacks tensor {name!r} (does it match its config.json?)")
        return sd.pop(name)

    out["tok_embeddings.weight"] = take("model.embed_tokens.weight")
    out["norm.weight"] = take("model.norm.weight")
    if args.tie_embeddings:
        sd.pop("lm_head.weight", None)
    else:
        out["output.weight"] = take("lm_head.weight")
    for ours, hf, moe in _block_plan(args):
        for o, h in _layer_names(args, moe):
            out[ours + o] = take(hf + h)
        if perm is not None:
            q = ours + _q_weight(args)[0]
            out[q] = _permute_q(out[q], args, perm)
            kv = ours + "attention.wkv_a.weight"
            out[kv] = _permute_kv_a(out[kv], args, perm)
        if not moe:
            continue
        bias = ours + "feed_forward.expert_bias"
        out[bias] = out[bias].float()
        ex = ours + "feed_forward.experts."
        if hf + "mlp.experts.gate_up_proj" in sd:  # transformers 5 in-memory layout
            w13 = take(hf + "mlp.experts.gate_up_proj")
            out[ex + "w1"], out[ex + "w3"] = (t.contiguous() for t in w13.chunk(2, dim=1))
            out[ex + "w2"] = take(hf + "mlp.experts.down_proj")
        else:
            for o, h in _EXPERT_NAMES:
                out[ex + o] = torch.stack(
                    [take(f"{hf}mlp.experts.{e}.{h}.weight") for e in range(args.n_routed_experts)]
                )
    mtp_prefix = f"model.layers.{args.n_layers}."
    if args.mtp_depth:
        for o, h in _MTP_NAMES:
            out[o] = take(mtp_prefix + h)
    leftover = [k for k in sd if not k.startswith(mtp_prefix) and not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise UserError(f"DeepSeek checkpoint has {len(leftover)} unexpected tensors, e.g. {leftover[:3]}")
    return out


def to_hf(state_dict: dict[str, torch.Tensor], args: DeepSeekArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> the on-disk ``DeepseekV3ForCausalLM`` layout (per-expert tensors, interleaved rope
    rows when ``hf_rope_interleave``), loadable by transformers 4/5 ``from_pretrained``, vLLM and SGLang.

    An MTP module goes to ``model.layers.{n_layers}.*`` (DeepSeek's layout; transformers' main model ignores
    it), without copies of the shared embedding and head.
    """
    sd = dict(state_dict)
    out: dict[str, torch.Tensor] = {}
    inv = torch.argsort(_rope_perm(args.qk_rope_head_dim)) if args.hf_rope_interleave else None
    out["model.embed_tokens.weight"] = sd.pop("tok_embeddings.weight")
    out["model.norm.weight"] = sd.pop("norm.weight")
    if not args.tie_embeddings:
        out["lm_head.weight"] = sd.pop("output.weight")
    for ours, hf, moe in _block_plan(args):
        for o, h in _layer_names(args, moe):
            out[hf + h] = sd.pop(ours + o)
        if inv is not None:
            q = hf + _q_weight(args)[1]
            out[q] = _permute_q(out[q], args, inv)
            kv = hf + "self_attn.kv_a_proj_with_mqa.weight"
            out[kv] = _permute_kv_a(out[kv], args, inv)
        if moe:
            ex = ours + "feed_forward.experts."
            for o, h in _EXPERT_NAMES:
                for e, w in enumerate(sd.pop(ex + o).unbind(0)):
                    out[f"{hf}mlp.experts.{e}.{h}.weight"] = w.contiguous()
    if args.mtp_depth:
        for o, h in _MTP_NAMES:
            out[f"model.layers.{args.n_layers}.{h}"] = sd.pop(o)
    if sd:
        raise ValueError(f"to_hf: unmapped tensors {sorted(sd)[:5]}")
    return out
