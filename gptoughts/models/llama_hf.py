"""Hugging Face interop of the Llama family: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM`` and ``ArceeForCausalLM`` checkpoints <-> :class:`~gptoughts.models.llama.Llama`.

The five share one layout (pre-norm, GQA, RoPE in the rotate_half convention); they differ by flags our
``LlamaArgs`` already has: q/k/v bias (Qwen2), q/k RMSNorm and an explicit ``head_dim`` (Qwen3), a sliding
window (Mistral; Qwen2/Qwen3 when ``use_sliding_window``), tied embeddings, and the MLP: SwiGLU, or Arcee's
ReLU² (``mlp = "relu2"``: ``up_proj``/``down_proj`` only, no gate; our ``w3``/``w2``). Of the speedrun
switches, ``qk_norm`` exports as Qwen3 and ``relu2`` as Arcee (not both: no architecture has both), the zero
inits need nothing, and ``logit_softcap`` has no counterpart: such a model is refused with one line naming the
switch. Weights map by renaming only (see the table in ``llama.py``), no permutation. Configs this code does
not reproduce exactly (other RoPE scalings, biases on ``o_proj`` or the MLP, another activation, irregular
``layer_types``) raise :class:`~gptoughts.models.hf.UnsupportedHFConfig`, and ``load_pretrained`` then takes the
generic ``transformers`` path instead of loading a model that would compute something else.

The adapter is the module-level ``HF_MODEL_TYPES, args_from_hf, hf_config, from_hf, to_hf`` (the contract of
``docs/internals.md``), registered on the llama ``Family`` in ``models/__init__.py``.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from gptoughts.errors import UserError
from gptoughts.models.hf import UnsupportedHFConfig
from gptoughts.models.llama import LlamaArgs

HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "arcee")
_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "arcee": "ArceeForCausalLM",
}

# Inside a block: our sub-module path -> the transformers one.
_BLOCK = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}


def hf_linear_names() -> dict[str, str]:
    """Hugging Face's name of each of a native block's linear layers -> ours (``q_proj`` -> ``wq``)."""
    return {
        hf.rsplit(".", 1)[-1]: ours.rsplit(".", 1)[-1] for ours, hf in _BLOCK.items() if "norm" not in ours
    }


_TOP = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
_TOP_BACK = {v: k for k, v in _TOP.items()}
_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


# ------------------------------------------------------------------------------------------------ config


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, our rope_scaling) from transformers 5 ``rope_parameters`` or 4.x ``rope_theta``/``rope_scaling``."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params and not any(isinstance(v, dict) for v in params.values()):
        theta = float(params.get("rope_theta", config.get("rope_theta") or 10000.0))
        scaling = params
    else:
        theta = float(config.get("rope_theta") or 10000.0)
        scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if float(config.get("partial_rotary_factor") or scaling.get("partial_rotary_factor") or 1.0) != 1.0:
        raise UnsupportedHFConfig("partial rotary embeddings")
    if kind == "default":
        return theta, None
    needed = {
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    }
    if kind not in needed:
        raise UnsupportedHFConfig(f"rope type {kind!r}")
    return theta, {"type": kind, **{k: scaling[k] for k in needed[kind]}}


def _window(config: dict[str, Any], model_type: str, n_layers: int) -> tuple[int | None, int]:
    """(sliding_window, full_attention_layers): which layers transformers runs with a sliding window."""
    window = config.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not config.get("use_sliding_window"):
        window = None
    if window is None:
        return None, 0
    types = config.get("layer_types")
    if types:
        sliding = [t == "sliding_attention" for t in types]
        if model_type == "mistral" or not any(sliding):
            # Mistral ignores layer_types (every layer is windowed); no sliding layer means full attention.
            return (int(window), 0) if model_type == "mistral" else (None, 0)
        first = sliding.index(True)
        if not all(sliding[first:]):
            raise UnsupportedHFConfig("sliding-window layers interleaved with full-attention layers")
        return int(window), first
    if model_type in ("qwen2", "qwen3"):
        first = int(config.get("max_window_layers") or 0)
        return (int(window), first) if first < n_layers else (None, 0)
    return int(window), 0


def args_from_hf(config: dict[str, Any]) -> LlamaArgs:
    """``LlamaArgs`` from a (resolved) transformers ``config.json`` of one of :data:`HF_MODEL_TYPES`."""
    model_type = config.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise UnsupportedHFConfig(f"model_type {model_type!r}")
    act = config.get("hidden_act", "relu2" if model_type == "arcee" else "silu")
    if act not in (("relu2",) if model_type == "arcee" else ("silu", "swish")):
        raise UnsupportedHFConfig(f"activation {act!r}")
    ffn_dim = int(config["intermediate_size"])
    if model_type == "arcee":  # our relu2 width is 3 * ffn_dim // 2 (LlamaArgs.ffn_hidden): invert it
        ffn_dim = 2 * ffn_dim // 3
        if 3 * ffn_dim // 2 != int(config["intermediate_size"]):
            raise UnsupportedHFConfig(f"a ReLU² width of {config['intermediate_size']} (not 3 * n // 2)")
    if config.get("mlp_bias"):
        raise UnsupportedHFConfig("bias on the MLP projections")
    # Llama/Qwen3 `attention_bias` also puts a bias on o_proj; Qwen2 has q/k/v biases only, always.
    if model_type != "qwen2" and config.get("attention_bias"):
        raise UnsupportedHFConfig("attention_bias (a bias on o_proj too)")
    d = int(config["hidden_size"])
    n_heads = int(config["num_attention_heads"])
    n_layers = int(config["num_hidden_layers"])
    head_dim = config.get("head_dim")
    if head_dim is not None and d % n_heads == 0 and int(head_dim) == d // n_heads:
        head_dim = None
    theta, scaling = _rope(config)
    window, full_layers = _window(config, model_type, n_layers)
    return LlamaArgs(
        d_model=d,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        ffn_dim=ffn_dim,
        vocab_size=int(config["vocab_size"]),
        max_seq_len=int(config.get("max_position_embeddings") or 2048),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        init_std=float(config.get("initializer_range", 0.02)),
        head_dim=int(head_dim) if head_dim is not None else None,
        sliding_window=window,
        full_attention_layers=full_layers,
        mlp="relu2" if model_type == "arcee" else "swiglu",
    )


def _compatible(args: LlamaArgs) -> dict[str, bool]:
    swiglu = args.mlp == "swiglu"
    return {
        "llama": swiglu and not args.qkv_bias and not args.qk_norm and args.sliding_window is None,
        "mistral": swiglu and not args.qkv_bias and not args.qk_norm and args.full_attention_layers == 0,
        "qwen2": swiglu and args.qkv_bias and not args.qk_norm,
        "qwen3": swiglu and args.qk_norm and not args.qkv_bias,
        "arcee": not swiglu and not args.qkv_bias and not args.qk_norm and args.sliding_window is None,
    }


def hf_model_type(args: LlamaArgs, preferred: str | None = None) -> str:
    """The transformers architecture that computes exactly what ``args`` describes (``preferred`` if it can).

    A model none computes is refused with one line naming the switch."""
    why = _not_exportable(args)
    if why:
        raise UserError(f"cannot export to Hugging Face format: {why}")
    ok = _compatible(args)
    if preferred in ok and ok[preferred]:
        return preferred
    return next(name for name in HF_MODEL_TYPES if ok[name])


def _not_exportable(args: LlamaArgs) -> str | None:
    """Why no architecture of :data:`HF_MODEL_TYPES` computes what ``args`` describes, or None."""
    if args.logit_softcap is not None:
        return f"model.logit_softcap = {args.logit_softcap} (transformers' Llama has no logit soft-cap)"
    if args.qkv_bias and args.qk_norm:
        return "model.qkv_bias with model.qk_norm (no transformers architecture has both; train with one)"
    if args.mlp == "relu2" and (args.qk_norm or args.qkv_bias):
        extra = "model.qk_norm" if args.qk_norm else "model.qkv_bias"
        return f"model.mlp = relu2 with {extra} (transformers' Arcee has the ReLU² MLP, not {extra})"
    if args.mlp == "relu2" and args.sliding_window is not None:
        return "model.mlp = relu2 with model.sliding_window (transformers' Arcee has no sliding window)"
    if args.sliding_window is not None and args.full_attention_layers and not (args.qkv_bias or args.qk_norm):
        return (
            f"model.full_attention_layers = {args.full_attention_layers} with model.sliding_window = "
            f"{args.sliding_window} (Mistral windows every layer; Qwen2 and Qwen3, which keep the first layers "
            "full, have model.qkv_bias or model.qk_norm)"
        )
    return None


def hf_config(args: LlamaArgs, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A transformers ``config.json`` for ``args``; ``base`` (the source model's config, when the run started
    from one) keeps its ``model_type`` when compatible and its other keys (token ids, ...) underneath ours."""
    model_type = hf_model_type(args, (base or {}).get("model_type"))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling:
        kind = args.rope_scaling.get("type", args.rope_scaling.get("rope_type"))
        rope = {
            **{k: v for k, v in args.rope_scaling.items() if k not in ("type", "rope_type")},
            "rope_type": kind,
            "rope_theta": args.rope_theta,
        }
    cfg: dict[str, Any] = dict(base) if base and base.get("model_type") == model_type else {}
    for stale in ("rope_scaling", "auto_map", "torch_dtype", "dtype"):
        cfg.pop(stale, None)
    cfg.update(
        architectures=[_ARCH[model_type]],
        model_type=model_type,
        hidden_size=args.d_model,
        intermediate_size=args.ffn_hidden,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.hd,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        tie_word_embeddings=args.tie_embeddings,
        hidden_act="relu2" if model_type == "arcee" else "silu",
        initializer_range=args.init_std,
        attention_dropout=0.0,
        use_cache=True,
        # transformers >= 5 reads rope_parameters; 4.x reads rope_theta (and ignores the other).
        rope_parameters=rope,
        rope_theta=args.rope_theta,
    )
    if model_type in ("llama", "qwen3", "arcee"):
        cfg["attention_bias"] = False
    if model_type in ("llama", "arcee"):
        cfg["mlp_bias"] = False
    if model_type == "mistral":
        cfg["sliding_window"] = args.sliding_window
    if model_type in ("qwen2", "qwen3"):
        sliding = args.sliding_window is not None
        cfg["use_sliding_window"] = sliding
        cfg["sliding_window"] = args.sliding_window
        cfg["max_window_layers"] = args.full_attention_layers if sliding else args.n_layers
        cfg["layer_types"] = [
            "sliding_attention" if sliding and i >= args.full_attention_layers else "full_attention"
            for i in range(args.n_layers)
        ]
    return cfg


# ------------------------------------------------------------------------------------------ state dicts


def from_hf(state_dict: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    """transformers names -> ours (tensors are not copied). Unknown names are kept as they are, so the strict
    load that follows names them."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name.endswith("rotary_emb.inv_freq"):  # a buffer some old checkpoints saved; we recompute it
            continue
        if name == "lm_head.weight" and args.tie_embeddings:  # tied: the embedding is the head
            continue
        m = _HF_LAYER.match(name)
        if m and m.group(2) in _BLOCK_BACK:
            out[f"layers.{m.group(1)}.{_BLOCK_BACK[m.group(2)]}.{m.group(3)}"] = tensor
            continue
        module, _, leaf = name.rpartition(".")
        out[f"{_TOP_BACK[module]}.{leaf}" if module in _TOP_BACK else name] = tensor
    return out


def to_hf(state_dict: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    """Our names -> transformers names. Tied models have no ``output`` and write no ``lm_head`` (transformers
    ties it to the embedding when it reads ``tie_word_embeddings``)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        m = _OURS_LAYER.match(name)
        if m and m.group(2) in _BLOCK:
            out[f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"] = tensor
            continue
        module, _, leaf = name.rpartition(".")
        if module not in _TOP:
            raise UserError(f"cannot export parameter {name!r}: it has no transformers counterpart")
        out[f"{_TOP[module]}.{leaf}"] = tensor
    return out
