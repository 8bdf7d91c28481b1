"""DeepSeek's hyper-parameters: ``DeepSeekArgs`` (validated field by field) and the size presets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from gptoughts.errors import ConfigError
from gptoughts.models.deepseek.rope import check_rope_scaling, rope_kind, yarn_mscale

__all__ = ["DEEPSEEK_SIZES", "DeepSeekArgs"]


@dataclass
class DeepSeekArgs:
    """Architecture hyper-parameters of a DeepSeek-V3-style model (build one with ``models.model_args``)."""

    KERNEL_FIELDS: ClassVar[frozenset[str]] = frozenset(
        {"moe_combine", "moe_permute", "moe_router", "moe_shared", "moe_w13"}
    )
    """The speed switches: other kernels, the same model and weights (a run resumes with them changed)."""

    d_model: int = 1024
    """Width of the residual stream (HF ``hidden_size``)."""
    n_layers: int = 16
    """Number of transformer blocks (HF ``num_hidden_layers``), the MTP block not included."""
    n_heads: int = 8
    """Attention heads (HF ``num_attention_heads``). MLA has no GQA: every head has its own k and v."""
    vocab_size: int = 32768
    """Embedding rows and logits; normally set from the tokenizer."""
    max_seq_len: int = 4096
    """Longest sequence the model accepts; sizes the RoPE tables and bounds KV caches."""
    q_lora_rank: int | None = None
    """Rank of the low-rank query projection (``wq_a -> q_norm -> wq_b``); None: one full ``wq`` (V2-Lite)."""
    kv_lora_rank: int = 512
    """Width of the compressed key/value latent (what the KV cache stores per token, plus the rope key)."""
    qk_nope_head_dim: int = 128
    """Per-head query/key dims without position encoding (expanded from the latent by ``wkv_b``)."""
    qk_rope_head_dim: int = 64
    """Per-head query dims with RoPE; the matching key part is one shared head (the decoupled rope key)."""
    v_head_dim: int = 128
    """Per-head value width."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: dict[str, Any] | None = None
    """Context extension: ``{"type": "linear", "factor"}``, the ``llama3`` scheme (see ``LlamaArgs``), or DeepSeek's
    ``{"type": "yarn", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
    "mscale_all_dim"}`` (HF ``rope_parameters``); None for none."""
    norm_eps: float = 1e-6
    """Epsilon of the block and final RMSNorms (HF ``rms_norm_eps``); the latent norms always use 1e-6."""
    n_routed_experts: int = 64
    """Routed (fine-grained) experts per MoE layer."""
    n_shared_experts: int = 2
    """Always-on experts per MoE layer, fused into one SwiGLU of width ``n_shared_experts * moe_inter_dim``."""
    n_activated_experts: int = 6
    """Routed experts per token (top-k; HF ``num_experts_per_tok``)."""
    moe_inter_dim: int = 320
    """Hidden width of each routed (and shared) expert (HF ``moe_intermediate_size``)."""
    dense_inter_dim: int = 2816
    """Hidden width of the SwiGLU of the dense layers (HF ``intermediate_size``)."""
    n_dense_layers: int = 1
    """The first this-many layers use a dense SwiGLU instead of MoE (HF ``first_k_dense_replace``)."""
    score_func: str = "sigmoid"
    """Router scores: ``"sigmoid"`` (V3; gates normalised over the chosen experts) or ``"softmax"`` (V2)."""
    route_scale: float = 2.5
    """Multiplies the routed gates (HF ``routed_scaling_factor``; 2.5 in DeepSeek-V3)."""
    norm_topk_prob: bool = True
    """Normalise the chosen experts' gates to sum to 1 (before ``route_scale``)."""
    n_expert_groups: int = 1
    """Group-limited routing (HF ``n_group``): experts are split in this many groups ..."""
    n_limited_groups: int = 1
    """... and each token picks its experts within the best this-many groups (HF ``topk_group``); a group's score
    is the sum of its two best biased scores (V3). 1/1 disables it."""
    bias_update_rate: float = 1e-3
    """Step of the aux-loss-free bias update per optimizer step (V3's gamma); 0 disables the update."""
    seq_aux_loss_coef: float = 1e-4
    """Weight of the sequence-wise balance loss (V3's alpha); 0 disables it (and skips its computation)."""
    mtp_depth: int = 0
    """Multi-token prediction modules: 0 (off) or 1 (one extra block predicting the token after next)."""
    mtp_loss_weight: float = 0.3
    """Weight of the MTP loss (V3's lambda: 0.3 for the first 10T tokens, then 0.1)."""
    tie_embeddings: bool = False
    """Use the token embedding matrix as the LM head."""
    init_std: float = 0.02
    """Std of the normal init; residual-branch outputs (``wo``, ``w2``) get ``init_std / sqrt(2 n_layers)``."""
    moe_combine: str = "hidden"
    """Speed switch (same model, other kernels): how each token's K expert outputs are summed with their gates.
    ``bmm`` (a batched GEMV ``[1, K] x [K, d]`` per token), ``sum`` (gate-weighted sum in fp32, one fused
    gather-reduction under compile) or ``hidden`` (the gate scales the expert's SwiGLU hidden row before ``w2``,
    where the rows are ``moe_inter_dim`` wide instead of ``d_model``; the sum over K is then unweighted). The default
    with ``moe_permute = gather``: the fastest pair on an H100 (bench/BENCHMARKS.md, "MoE step")."""
    moe_permute: str = "gather"
    """Speed switch: how tokens move to the expert-sorted rows and back. ``index_put`` (the K copies of each
    token materialised, scattered, gathered back by indexing) or ``gather`` (one gather each way, backward the
    inverse gather-sum, only indices saved; needs ``moe_combine`` = ``sum`` or ``hidden``)."""
    moe_router: str = "mask"
    """Speed switch of group-limited routing (``n_expert_groups > 1``): the final top-k runs over the biased
    scores with the other groups masked to -inf (``mask``, an ``[N, E]`` copy) or over the kept groups' scores
    gathered (``gather``, ``[N, n_limited_groups * E / n_expert_groups]``); the same experts and gates."""
    moe_shared: str = "after"
    """Speed switch: when the shared experts run. ``after`` the routed ones, ``before`` them (the compiled
    block's scheduler sees them first), or ``stream``: on a side CUDA stream, overlapping the router and the
    dispatch (eager CUDA only; a compiled block runs them as ``before``)."""
    moe_w13: str = "fused"
    """Speed switch: the routed experts' gate and up projections (``w1``, ``w3``) as two grouped GEMMs
    (``separate``) or as one over both weights concatenated at the cast (``fused``, the default: one GEMM twice
    as wide, which measured faster; bench/BENCHMARKS.md). The weights stay two parameters either way."""
    hf_rope_interleave: bool = True
    """Checkpoint layout only (HF ``rope_interleave``): whether HF weights store the rope dims as interleaved pairs.
    ``from_hf``/``to_hf`` permute accordingly; the model itself always computes in the rotate_half layout."""

    def __post_init__(self) -> None:
        self._check_sizes()
        if self.score_func not in ("sigmoid", "softmax"):
            raise ConfigError(f"model.score_func must be 'sigmoid' or 'softmax', got {self.score_func!r}")
        if self.mtp_depth not in (0, 1):
            raise ConfigError(f"model.mtp_depth must be 0 or 1, got {self.mtp_depth}")
        for name in ("bias_update_rate", "seq_aux_loss_coef", "mtp_loss_weight", "route_scale"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.{name} must be >= 0, got {getattr(self, name)}")
        self._check_groups()
        self._check_moe_switches()
        check_rope_scaling(self.rope_scaling)

    def _check_sizes(self) -> None:
        """Widths, counts and layer split: positive, even where RoPE needs it, within their bounds."""
        for name in (
            "d_model",
            "n_layers",
            "n_heads",
            "vocab_size",
            "max_seq_len",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "n_routed_experts",
            "n_activated_experts",
            "moe_inter_dim",
            "dense_inter_dim",
            "n_expert_groups",
            "n_limited_groups",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ConfigError(f"model.q_lora_rank must be positive or None, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"model.qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")
        if self.n_shared_experts < 0:
            raise ConfigError(f"model.n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ConfigError(
                f"model.n_dense_layers must be in [0, n_layers={self.n_layers}], got {self.n_dense_layers}"
            )
        if self.n_activated_experts > self.n_routed_experts:
            raise ConfigError(
                f"model.n_activated_experts ({self.n_activated_experts}) exceeds n_routed_experts ({self.n_routed_experts})"
            )

    def _check_groups(self) -> None:
        """Group-limited routing: the groups split the experts evenly and still hold the experts a token picks."""
        g, tg = self.n_expert_groups, self.n_limited_groups
        if self.n_routed_experts % g:
            raise ConfigError(
                f"model.n_expert_groups ({g}) must divide n_routed_experts ({self.n_routed_experts})"
            )
        if tg > g:
            raise ConfigError(f"model.n_limited_groups ({tg}) exceeds n_expert_groups ({g})")
        if g > 1 and self.n_routed_experts // g < 2:
            raise ConfigError(
                "group-limited routing needs at least 2 experts per group (groups score their top 2)"
            )
        if g > 1 and tg * (self.n_routed_experts // g) < self.n_activated_experts:
            raise ConfigError("n_limited_groups groups hold fewer experts than n_activated_experts")

    def _check_moe_switches(self) -> None:
        choices = {
            "moe_combine": ("bmm", "sum", "hidden"),
            "moe_permute": ("index_put", "gather"),
            "moe_router": ("mask", "gather"),
            "moe_shared": ("after", "before", "stream"),
            "moe_w13": ("separate", "fused"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    f"model.{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
                )
        if self.moe_permute == "gather" and self.moe_combine == "bmm":
            raise ConfigError(
                "model.moe_permute = gather sums the K expert outputs in its own pass: "
                "set model.moe_combine = sum or hidden"
            )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    @property
    def softmax_scale(self) -> float:
        """``1/sqrt(qk_head_dim)``, times yarn's ``mscale(factor, mscale_all_dim)**2`` when that is configured."""
        scale = self.qk_head_dim**-0.5
        s = self.rope_scaling or {}
        if rope_kind(s) not in ("default", None) and s.get("mscale_all_dim"):
            m = yarn_mscale(float(s["factor"]), float(s["mscale_all_dim"]))
            scale *= m * m
        return scale


# Size presets: field overrides of DeepSeekArgs.
DEEPSEEK_SIZES: dict[str, dict[str, Any]] = {
    "debug": dict(
        d_model=64,
        n_layers=3,
        n_heads=4,
        vocab_size=512,
        max_seq_len=256,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        n_activated_experts=2,
        moe_inter_dim=32,
        dense_inter_dim=128,
        n_dense_layers=1,
    ),
    # 1.12B total / 263M active with vocab 32768.
    "small": dict(
        d_model=1024,
        n_layers=16,
        n_heads=8,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        n_shared_experts=2,
        n_activated_experts=6,
        moe_inter_dim=320,
        dense_inter_dim=2816,
        n_dense_layers=1,
    ),
    # DeepSeek-V2-Lite shape: 15.7B total, 2.45B active without the input embedding (DeepSeek: 2.4B).
    "16b": dict(
        d_model=2048,
        n_layers=27,
        n_heads=16,
        vocab_size=102400,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        n_shared_experts=2,
        n_activated_experts=6,
        moe_inter_dim=1408,
        dense_inter_dim=10944,
        n_dense_layers=1,
    ),
}
