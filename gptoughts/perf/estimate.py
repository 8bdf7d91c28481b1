"""``gptoughts estimate``: memory, time and cost of a run before it starts.

Memory is the peak of a training step with fp32 master weights and mixed precision: weights, gradients,
optimizer state (per ``train.optimizer_states``), autocast weight copies, activations counted per family and
activation-checkpointing mode from the block's ops, and the LM-head logits; under FSDP the sharded parts are
divided by the GPU count and the gathered blocks added. Time is tokens × FLOPs/token / (peak FLOP/s × MFU), with
a default MFU per size class measured on Hopper; ``--mfu`` overrides it; a micro-batch step never takes less than
:data:`MIN_STEP_S` (tiny models are bound by kernel launches, not FLOPs). The full breakdown and the
measurements it was checked against: docs/performance.md, "Memory and time estimate".
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from gptoughts import models
from gptoughts.errors import ConfigError
from gptoughts.perf.checkpointing import resolve as resolve_ac
from gptoughts.perf.hardware import _PEAK_BF16, arch_of, fp8_auto, has_fp8, match_gpu, peak_flops

GIB = 2**30

# $/hour, on-demand list prices seen at common GPU clouds (the INL guide's table, updated); override with --price.
DEFAULT_PRICE = {
    "H200": 3.5,
    "H100": 2.5,
    "A100": 1.5,
    "L40S": 1.0,
    "RTX 4090": 0.4,
    "RTX 3090": 0.3,
    "A10G": 1.0,
    "L4": 0.7,
    "T4": 0.35,
    "V100": 0.8,
    "B200": 5.0,
}
# The least a training micro-batch step takes on a GPU, whatever its FLOPs: a tiny model is bound by launching its
# kernels, and its FLOP-bound speed is fiction. Under every step measured on an H200 (docs/performance.md), so
# where it binds the speed is an upper bound.
MIN_STEP_S = 4.5e-3

GPU_MEMORY_GIB = {
    "H200": 141,
    "GH200": 96,
    "H100 NVL": 94,
    "H100": 80,
    "A100": 80,
    "L40S": 48,
    "L40": 48,
    "A10": 24,
    "RTX 4090": 24,
    "RTX 3090": 24,
    "A10G": 24,
    "L4": 24,
    "T4": 16,
    "V100": 32,
    "B200": 180,
}


@dataclass
class Estimate:
    params: int
    params_non_embedding: int
    weights_gib: float
    gradients_gib: float
    optimizer_gib: float
    autocast_copies_gib: float
    activations_gib: float
    logits_gib: float
    total_gib: float
    gpu: str
    gpu_memory_gib: float | None
    fits: bool | None
    flops_per_token: float
    mfu: float
    tokens_per_s: float | None
    tokens: int | None
    hours: float | None
    price_per_hour: float | None
    cost: float | None
    strategy: str = "ddp"
    host_gib: float = 0.0
    """CPU memory per process for what ``cpu_offload`` keeps there (fp32 weights, gradients, optimizer state)."""
    checkpoint_staging_gib: float = 0.0
    """CPU memory per saving process that background checkpoints keep for the whole run: one host copy of the
    process's fp32 weights and optimizer state (``HostStaging``, ``training/checkpoint/staging.py``; each rank's
    shards under FSDP, rank 0's whole state for one process or DDP)."""
    optimizer_states: str = "fp32"
    """How AdamW's moments are stored (``train.optimizer_states``): what ``optimizer_gib`` counts."""
    flops_tokens_per_s: float | None = None
    """The speed FLOPs alone allow at ``mfu``. ``tokens_per_s`` is lower where a step would take less than
    :data:`MIN_STEP_S` (a tiny model): it is then that floor's speed, an upper bound."""
    activation_checkpointing: str = "none"
    """The activation checkpointing the figures assume."""
    layout: dict[str, str] = field(default_factory=dict)
    """What train's memory layout chooser changed of the settings left to their defaults (``perf/layout.py``):
    each field -> its value and why, as the plan prints it (``estimate_config``)."""
    refusal: str | None = None
    """The line train refuses the run with when no layout fits (``estimate_config``); None: it runs."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# What torchao's float8 linears (tensorwise, per-block compile) save less than bf16 per token and layer without
# checkpointing: the compiled graph keeps the fp8 copies of the linears' inputs instead of bf16 ones. Fitted to the
# user path's measured peaks at 1b and 3b (bench/BENCHMARKS.md, "fp8's memory estimate").
FP8_SAVED_LESS_PER_D, FP8_SAVED_LESS_PER_F = 9.0, 0.4


def _layer_activation_bytes(args: Any, mode: str, residual_bytes: int = 4, fp8: bool = False) -> float:
    """Bytes saved for backward per token per block (bf16 activations; the residual stream in fp32, r = 4
    bytes, or bf16, r = 2: ``perf.residual_dtype``).

    none: attention-norm input (r d) and output (2d), q/k/v after RoPE (2(d + 2 d_kv)), attention output and
    softmax stats (2d), FFN-norm input and output (r d + 2d), w1 and w3 outputs and their product (3 × 2f):
    (8 + 2r) d + 4 d_kv + 6f. Measured on an H200 with per-block compile (bench/BENCHMARKS.md): fp32 residual,
    26.9 KB per token and layer at 125m (formula 27.6 KB) and 81.5 KB at 1b (formula 84.0 KB); bf16 residual,
    77.4 KB at 1b (formula 75.8 KB). selective keeps the block input (r d), the attention's matmul outputs (q and
    o: 4d; k and v: 4 d_kv), SDPA's output (2d) and w1's and w3's outputs (4f), and recomputes norms, activations
    and the weights' casts: (r + 6) d + 4 d_kv + 4f, what a trace of the compiled block's saved tensors shows
    (checked against 3b's measured peaks: bench/BENCHMARKS.md). full keeps only the block input (r d).
    ``fp8`` (torchao's float8 linears): none keeps ``FP8_SAVED_LESS_PER_D d + FP8_SAVED_LESS_PER_F f`` less;
    selective and full keep what they keep in bf16 (not measured under fp8: counted as bf16, the safe side).

    Speedrun switches (not measured; counted as above): ``qk_norm`` adds q and k before their norm (2(d + d_kv));
    ``mlp = "relu2"`` keeps w3's output and its square (2 × 2h, h = ``ffn_hidden`` = 3f/2: the same 6f as the
    SwiGLU), and selective keeps w3's output only (2h = 3f instead of 4f).
    """
    r = residual_bytes
    d = args.d_model
    head_dim = getattr(args, "head_dim", None) or d // args.n_heads
    d_kv = getattr(args, "n_kv_heads", args.n_heads) * head_dim
    f = getattr(args, "ffn_dim", 4 * d)
    relu2 = getattr(args, "mlp", "swiglu") == "relu2"
    if mode == "none":
        qk_norm = 2 * (d + d_kv) if getattr(args, "qk_norm", False) else 0
        mlp = 4 * args.ffn_hidden if relu2 else 6 * f
        fp8_less = FP8_SAVED_LESS_PER_D * d + FP8_SAVED_LESS_PER_F * f if fp8 else 0.0
        return (8 + 2 * r) * d + 4 * d_kv + mlp + qk_norm - fp8_less
    if mode == "selective":
        return (r + 6) * d + 4 * d_kv + (2 * args.ffn_hidden if relu2 else 4 * f)
    if mode == "full":
        return r * d
    raise ConfigError(f"activation checkpointing must be none, selective or full; got {mode!r}")


def _gpt2_layer_bytes(args: Any, mode: str, r: int) -> float:
    """GPT-2 block (LayerNorm, fused q/k/v without RoPE, GELU MLP ``f = 4d`` wide), counted as the Llama block.

    none: ln_1 input and output (r d + 2d), q/k/v (6d), attention output (2d), ln_2 input and output (r d + 2d),
    c_fc output and its GELU (2 × 2f): (12 + 2r) d + 4f. selective: the block input and every addmm's output the
    policy keeps (q/k/v 6d, SDPA's output 2d, the attention's and the MLP's projections 2 × 2d, c_fc 2f):
    (r + 12) d + 2f; full: r d. Held to measured peaks by tests/perf/test_estimate.py.
    """
    d, f = args.d_model, args.ffn
    if mode == "none":
        return (12 + 2 * r) * d + 4 * f
    if mode == "selective":
        return (r + 12) * d + 2 * f
    return r * d


def _inl_layer_bytes(args: Any, mode: str, r: int) -> float:
    """INL block: Llama's attention (RMSNorm, GQA, RoPE), the integrator, and a GELU FFN ``f`` wide.

    The integrator's state is fp32 (``x - μ`` promotes it: μ is an fp32 parameter), so with K > 0 the residual
    stream is fp32 after the first block whatever ``residual_dtype`` says: r = 4 is used. With ``H =
    controller_hidden``, the integrator saves its input ``h`` (2d, the first controller matmul's input) and, per
    iteration, what the compiled block keeps for backward: x and v in fp32 (8d), their bf16 copy fed to ``W_xv``
    (4d), the controller's 4d-wide output in bf16 (8d), the controller's hidden pre- and post-GELU (4H), and 2d
    more (one bf16 ``[B, T, d]`` intermediate: what the measured peak below implies, not traced op by op):
    K (22d + 4H) + 2d. (Eager mode keeps about twice that: each of the ~15 elementwise ops saves an operand.)

    none: attention as Llama's ((6 + r) d + 4 d_kv), the integrator, FFN-norm input and output ((r + 2) d),
    fc1 output and its GELU (4f). Against the measured inl/3b peak (K = 4; H200, per-block compile, fp32
    residual, batch 2 × 2048: 67.2 GiB, bench/BENCHMARKS.md families table) the estimate gives 68.4 GiB (+1.8%).
    selective: the block input (r d), the attention's matmul outputs (q and o: 4d; k and v: 4 d_kv) and SDPA's
    output (2d), what the compiled block saves (traced), fc1's output (2f), the controller's matmul outputs
    the policy keeps, and 2d more (a bf16 ``[B, T, d]`` tensor the trace does not show and the measured slope
    implies): (r + 8) d + 4 d_kv + 2f + K (8d + 4H); full: r d. With the Triton integrator at 3b this gives 3.77
    GiB per 2048-token row against 3.78 measured between micro-batches 8 and 27 (bench/BENCHMARKS.md).
    ``integrator_impl = "fused"`` (none): h, x_i and v_i in fp32 for i = 1..K-1, and c_i: 2d + (K-1) 8d + 2KH
    (what its autograd Function saves). Against the measured inl/3b peak of 48.0 GiB (H100, bf16 residual, batch
    2 × 2048, no checkpointing) the estimate gives 48.3 GiB.
    """
    d, f, k = args.d_model, args.ffn, args.n_iterations
    d_kv = args.kv_heads * args.hd
    if k > 0:
        r = 4
    if mode == "none":
        return (8 + 2 * r) * d + 4 * d_kv + 4 * f + _integrator_bytes(args, mode)
    if mode == "selective":
        return (r + 8) * d + 4 * d_kv + 2 * f + _integrator_bytes(args, mode)
    return r * d


def _integrator_bytes(args: Any, mode: str) -> float:
    """What INL's integrator saves per token and block (``_inl_layer_bytes`` gives the terms): none, reference
    2d + K (22d + 4H), fused 2d + (K-1) 8d + 2KH, triton 2d + (K-1) 8d + 4KH; selective K (8d + 4H), triton 4H;
    full nothing (the block input only)."""
    d, hid, k = args.d_model, args.controller_hidden, args.n_iterations
    if k == 0 or mode == "full":
        return 0.0
    # a run records "triton" only where the kernels run (training/modeling.py: elsewhere "fused")
    impl = getattr(args, "integrator_impl", "reference")
    if mode == "selective" and impl == "triton":
        return 4 * hid  # c_h and c_0 (bf16): the kernels' op is recomputed like any non-matmul op
    if mode == "selective":
        return k * (8 * d + 4 * hid)
    if impl == "fused":
        return 2 * d + (k - 1) * 8 * d + 2 * k * hid
    if impl == "triton":  # the fused Function's set, with c_i in fp32
        return 2 * d + (k - 1) * 8 * d + 4 * k * hid
    return 2 * d + k * (22 * d + 4 * hid)


def _deepseek_layer_bytes(args: Any, mode: str, r: int, moe: bool) -> float:
    """DeepSeek block: MLA, then a dense SwiGLU (the first ``n_dense_layers``) or the MoE, counted per token.

    MLA (``H`` heads, q/k head dim ``qk``, value dim ``v``, latent ``c`` of ``kv_lora_rank``, rope key ``rope``):
    norm input and output ((r + 2) d), the optional q-LoRA latent and its norm (4 q_lora_rank), the latent with
    the rope key (2 (c + rope)), the normed latent (2c), the q, k and v SDPA saves (2 H (2 qk + v)) and the
    attention output (2 H v). Then FFN-norm input and output ((r + 2) d) and either the dense SwiGLU (6 f_dense,
    as Llama) or the MoE with ``k`` active of the routed experts of width ``m`` and shared experts of total width
    ``s``: the router's fp32 input and scores (4d + 8E), each token's k dispatched copies (2kd), their SwiGLUs
    (6km: only the *active* experts hold activations, idle experts none), the gathered expert outputs (2kd; under
    ``moe_combine = hidden`` the gate-weighted hidden rows instead, 2km) and the shared SwiGLU (6s); the 3-D expert
    weights' bf16 copies are in the autocast line. Held to the measured peaks by tests/perf/test_estimate.py.
    selective: the block input plus the matmul outputs the policy keeps: MLA's projections, SDPA's and wo's
    outputs, then the dense SwiGLU's w1/w3 and w2 (4 f_dense + 2d), or the router's fp32 logits, the shared
    experts' w1/w3 and w2 (4E + 4s + 2d); the routed experts run through ``torch._grouped_mm``, which the policy
    recomputes. full: r d (not measured). The MTP block (``mtp_depth = 1``) is
    outside ``model.layers``, so it is never checkpointed: ``_activation_bytes`` adds it as one more block.
    """
    d, h = args.d_model, args.n_heads
    if mode == "full":
        return r * d
    if mode == "selective":
        # MLA's matmul and attention outputs: q (or q-LoRA's latent and q), the latent with the rope key, the
        # expanded keys and values, SDPA's output and wo's
        q = 2 * h * args.qk_head_dim + (2 * args.q_lora_rank if args.q_lora_rank else 0)
        nope_v = args.qk_nope_head_dim + args.v_head_dim
        kv = 2 * (args.kv_lora_rank + args.qk_rope_head_dim) + 2 * h * nope_v
        mla = r * d + q + kv + 2 * h * args.v_head_dim + 2 * d
        if not moe:
            return mla + 4 * args.dense_inter_dim + 2 * d
        return mla + 4 * args.n_routed_experts + 4 * args.n_shared_experts * args.moe_inter_dim + 2 * d
    qk, v, c, rope = args.qk_head_dim, args.v_head_dim, args.kv_lora_rank, args.qk_rope_head_dim
    q_lora = 4 * args.q_lora_rank if args.q_lora_rank else 0
    attn = (r + 2) * d + q_lora + 2 * (c + rope) + 2 * c + 2 * h * (2 * qk + v) + 2 * h * v
    if not moe:
        return attn + (r + 2) * d + 6 * args.dense_inter_dim
    k, m, e = args.n_activated_experts, args.moe_inter_dim, args.n_routed_experts
    # moe_combine = hidden weights the hidden rows (w2's input, 2km) and sums w2's outputs, which keeps nothing;
    # the other combines keep the k expert outputs (2kd) for the gates' gradient.
    combine = 2 * k * m if getattr(args, "moe_combine", None) == "hidden" else 2 * k * d
    routed = 4 * d + 8 * e + 2 * k * d + 6 * k * m + combine
    return attn + (r + 2) * d + routed + 6 * args.n_shared_experts * m


def _activation_bytes(family: str, args: Any, mode: str, r: int, fp8: bool = False) -> tuple[float, float]:
    """(bytes per token saved for backward by all blocks in ``mode``, the most one block saves without
    checkpointing, i.e. what the block being recomputed under ``full`` rebuilds during its backward).

    Activation bytes per token and block without checkpointing (d = ``d_model``, f = FFN width, d_kv = key/value
    width, r = residual bytes; the function named gives the selective and full modes and what is counted):

    * llama, llada: (8 + 2r) d + 4 d_kv + 6f (``_layer_activation_bytes``, measured on an H200);
    * gpt2: (12 + 2r) d + 4f (LayerNorm, q/k/v without GQA, 4d GELU MLP; ``_gpt2_layer_bytes``);
    * inl: (8 + 2r) d + 4 d_kv + 4f + 2d + K (22d + 4H), with r = 4 once the integrator's fp32 state joins the
      residual stream, K integrator iterations and H the controller's width (``_inl_layer_bytes``);
    * deepseek: MLA (latent, q/k/v, output) plus, in the dense layers, a SwiGLU, and in the MoE layers the router,
      each token's copies through its *active* experts only and the shared experts (``_deepseek_layer_bytes``);
      an MTP block counts as one more, never checkpointed, block.

    ``fp8`` (torchao's float8 linears) lowers llama's and llada's (``_layer_activation_bytes``); the other families
    are counted as in bf16 (not measured under fp8; too high, never too low).
    """
    if mode not in ("none", "selective", "full"):
        raise ConfigError(f"activation checkpointing must be none, selective or full; got {mode!r}")
    L = args.n_layers
    if family == "gpt2":
        return _gpt2_layer_bytes(args, mode, r) * L, _gpt2_layer_bytes(args, "none", r)
    if family == "inl":
        return _inl_layer_bytes(args, mode, r) * L, _inl_layer_bytes(args, "none", r)
    if family == "deepseek":
        dense, moe = args.n_dense_layers, args.n_moe_layers
        per_layer = dense * _deepseek_layer_bytes(args, mode, r, False)
        per_layer += moe * _deepseek_layer_bytes(args, mode, r, True)
        kinds = [False] * (dense > 0) + [True] * (moe > 0)
        rebuilt = max(_deepseek_layer_bytes(args, "none", r, is_moe) for is_moe in kinds)
        if (
            mode == "selective"
        ):  # the block in its backward recomputes what the policy did not keep (routed experts)
            per_layer += rebuilt
        if args.mtp_depth:
            # The MTP block is outside ``model.layers``: never checkpointed. Plus its two input norms and the
            # concatenated bf16 input of eh_proj.
            per_layer += _deepseek_layer_bytes(args, "none", r, moe > 0) + (2 * r + 8) * args.d_model
        return per_layer, rebuilt
    # llama, llada (LlamaArgs) and any family with Llama's field names.
    return _layer_activation_bytes(args, mode, r, fp8) * L, _layer_activation_bytes(args, "none", r)


def kept_by_compiled_full(family: str, args: Any) -> float:
    """Bytes per token that compiled full activation checkpointing keeps besides the blocks' inputs on a torch
    without pytorch/pytorch#177396 (``checkpointing.compile_recomputes_functions``; torch 2.11 has the fault): what
    our autograd Functions save, DeepSeek's permuted rows (one ``[tokens × k, d]`` bf16 tensor a MoE block) and INL's
    fused integrator's set. 0 on a torch with the fix."""
    if (
        family == "deepseek"
        and getattr(args, "moe_permute", "") == "gather"
        and getattr(args, "n_moe_layers", 0)
    ):
        kept = 2.0 * args.n_activated_experts * args.d_model * args.n_moe_layers
    elif family == "inl" and getattr(args, "integrator_impl", "") == "fused" and args.n_iterations > 0:
        k, d, h = args.n_iterations, args.d_model, args.controller_hidden
        kept = float((2 * d + (k - 1) * 8 * d + 2 * k * h) * args.n_layers)
    else:
        return 0.0
    from gptoughts.perf.checkpointing import compile_recomputes_functions

    return 0.0 if compile_recomputes_functions() else kept


def _tp_whole_bytes(family: str, args: Any, mode: str) -> tuple[float, float]:
    """Under tensor parallelism, the bytes per token saved for backward that every rank of the group keeps whole (not
    divided by ``tp``): ``(of them counted in the mode's formula, added to it)``.

    The column-parallel projections' inputs are all-gathered along the sequence (the attention-norm output feeding
    q/k/v, the FFN-norm output feeding w1/w3: 2 × 2d in bf16 per block) and saved whole for their weight gradient.
    Without checkpointing the formula counts them (the norm outputs): they move from divided to whole. Selective
    checkpointing keeps a collective's output rather than redo it: they come on top of its formula. INL's
    integrator runs on the gathered sequence (``parallel/tp.py``): its activations are whole in both modes. Full
    checkpointing keeps only the (sequence-split) block inputs: nothing whole. The measured peaks these match:
    docs/performance.md, "Memory and time estimate"."""
    if mode == "full" or family not in ("llama", "llada", "inl"):
        return 0.0, 0.0
    gathered = 4.0 * args.d_model * args.n_layers
    integrator = _integrator_bytes(args, mode) * args.n_layers if family == "inl" else 0.0
    if mode == "none":
        return gathered + integrator, 0.0
    return integrator, gathered


def estimate(
    family: str,
    size: str,
    overrides: dict | None = None,
    *,
    batch_size: int = 8,
    block_size: int = 2048,
    activation_checkpointing: str = "none",
    loss: str = "chunked",
    loss_chunk: int = 4096,
    gpu: str = "H100",
    tokens: int | None = None,
    mfu: float | None = None,
    price: float | None = None,
    num_gpus: int = 1,
    residual_dtype: str = "bf16",
    strategy: str = "ddp",
    optimizer: str = "adamw",
    optimizer_states: str = "fp32",
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
    tp: int = 1,
    accum_unsharded_grads: bool = False,
    grad_accum: int = 1,
    keep_grads: bool = False,
    muon_graph: bool = False,
    fp8: bool = False,
) -> Estimate:
    """Peak memory of one training step, speed and cost for ``family`` at ``size`` (module docstring: each line;
    the activations per family: ``_activation_bytes``; tensor parallelism, FSDP, offload: ``_place``).
    ``grad_accum`` > 1: the gradients accumulated so far live beside the next micro-batch's activations;
    ``keep_grads`` (CUDA graphs): the gradients stay allocated between steps, beside the activations too;
    ``muon_graph``: Muon's recorded step keeps its working memory (:func:`muon_graph_bytes`); ``fp8``: the blocks'
    linears are torchao's float8 ones (fewer saved bytes: :func:`_layer_activation_bytes`; speed:
    :func:`fp8_speedup`)."""
    if fp8 and has_fp8(gpu) is False:  # as train refuses it there (perf/fp8.py)
        raise ConfigError(
            f"--fp8 needs fp8 tensor cores (Ada, Hopper or newer); the {gpu} has none: drop --fp8, or estimate "
            "for another --gpu"
        )
    args, model = _meta_model(family, size, overrides)
    n = model.num_params()
    tokens_step = batch_size * block_size
    if residual_dtype not in ("fp32", "bf16"):
        raise ConfigError(f"residual dtype must be fp32 or bf16; got {residual_dtype!r}")
    r = 4 if residual_dtype == "fp32" else 2
    per_token, rebuilt = _activation_bytes(
        models.get_family(family).name, args, activation_checkpointing, r, fp8
    )
    act = per_token * tokens_step
    name = models.get_family(family).name
    if activation_checkpointing == "full":
        # The block in its backward holds its rebuilt activations and their gradients (measured on an H200 with
        # llama, llada, gpt2 and inl: 4-10% low with the first alone); where torch keeps more of a Function's
        # tensors (DeepSeek's rows), those stand for the gradients' copy (measured: +17% with both).
        kept = kept_by_compiled_full(name, args)
        act += (rebuilt + max(kept, rebuilt)) * tokens_step
    counted, added = _tp_whole_bytes(name, args, activation_checkpointing) if tp > 1 else (0.0, 0.0)
    logits = _logits_bytes(args, loss, loss_chunk, tokens_step)
    if strategy not in ("ddp", "fsdp"):
        raise ConfigError(f"strategy must be ddp or fsdp; got {strategy!r}")
    b = _Bytes(
        weights=4 * n,
        grads=4 * n,
        optim=_optimizer_bytes(model, n, optimizer, optimizer_states)
        + (muon_graph_bytes(model) if muon_graph and optimizer == "muon" else 0.0),
        copies=2 * _matmul_params(model, one_block=activation_checkpointing != "none"),
        act=act,
        logits=logits,
        act_whole=(counted + added) * tokens_step,
        act_added=added * tokens_step,
    )
    strategy = _place(
        b, model, n, tp, num_gpus, strategy, cpu_offload, reshard_after_forward, accum_unsharded_grads,
        grad_accum > 1 or keep_grads,
    )  # fmt: skip
    speed = _speed_and_cost(
        gpu, args.d_model, model.flops_per_token(block_size), mfu, num_gpus, tokens, price,
        tokens_step=tokens_step, data_ranks=max(1, num_gpus // tp), fp8=fp8,
    )  # fmt: skip
    mem = speed.pop("gpu_memory_gib")
    # as the plan: host-device copies and the CPU's optimizer step bound offload, not the GPU's FLOPs
    if cpu_offload:
        speed.update(tokens_per_s=None, flops_tokens_per_s=None, hours=None, cost=None)
    return Estimate(
        params=n,
        params_non_embedding=model.num_params(non_embedding=True),
        weights_gib=b.weights / GIB,
        gradients_gib=b.grads / GIB,
        optimizer_gib=b.optim / GIB,
        autocast_copies_gib=b.copies / GIB,
        activations_gib=b.act / GIB,
        logits_gib=b.logits / GIB,
        total_gib=b.total / GIB,
        gpu=gpu,
        gpu_memory_gib=mem,
        fits=(b.total / GIB <= mem * 0.95) if mem else None,
        strategy=strategy if num_gpus > 1 or cpu_offload else "ddp",
        host_gib=b.host / GIB,
        checkpoint_staging_gib=b.staging / GIB,
        optimizer_states=optimizer_states,
        activation_checkpointing=activation_checkpointing,
        **speed,
    )


@dataclass
class _Bytes:
    """One training step's memory per GPU, part by part, in bytes (host: per process, for offload; staging: the
    host copy background checkpoints keep)."""

    weights: float
    grads: float
    optim: float
    copies: float
    act: float
    logits: float
    host: float = 0.0
    staging: float = 0.0
    total: float = 0.0
    act_whole: float = 0.0
    """Of the activations, what every tensor-parallel rank keeps whole (:func:`_tp_whole_bytes`)..."""
    act_added: float = 0.0
    """...of which ``act`` does not count yet (added under tensor parallelism)."""


def _matmul_params(model: Any, one_block: bool = False) -> int:
    """Weights autocast casts to bf16 and keeps for backward: every matrix (and DeepSeek's 3-D expert stacks) except
    embedding lookups, which read rows without a cast; a tied LM head is a matmul, so it counts. ``one_block``
    (full or selective checkpointing): a block's casts are made inside its checkpointed forward and made again
    in its recompute (the selective policy saves matmul outputs, not the casts), so only one block's are live at
    a time, beside the head's."""
    import torch

    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    lookups.discard(id(model.output_weight))

    def count(params: Any) -> int:
        return sum(p.numel() for p in params if p.ndim >= 2 and id(p) not in lookups)

    if not one_block:
        return count(model.parameters())
    inside = {id(p) for p in model.layers.parameters()}
    outside = count(p for p in model.parameters() if id(p) not in inside)
    return outside + max(count(layer.parameters()) for layer in model.layers)


def _logits_bytes(args: Any, loss: str, loss_chunk: int, tokens_step: int) -> float:
    """chunked: fp32 logits + their gradient for one chunk, plus the fp32 head-weight gradient accumulator;
    plain: bf16 logits, their fp32 upcast and its gradient, for the whole batch. DeepSeek's MTP is a second
    LM-head loss (its own head-gradient accumulator, or its own logits)."""
    vocab = args.vocab_size
    rows = min(loss_chunk, tokens_step) if loss == "chunked" else tokens_step
    logits = rows * vocab * 8 + vocab * args.d_model * 4 if loss == "chunked" else rows * vocab * (2 + 4 + 4)
    if getattr(args, "mtp_depth", 0):
        logits += vocab * args.d_model * 4 if loss == "chunked" else rows * vocab * (2 + 4 + 4)
    return logits


def _optimizer_bytes(model: Any, n: int, optimizer: str, optimizer_states: str) -> float:
    """AdamW keeps two moments per parameter (8 bytes in fp32; ``optimizer_states``: STATE_BYTES); Muon one fp32
    momentum buffer (4 bytes) for the hidden matrices it trains, AdamW's two for the rest (models.hidden_matrices)."""
    if optimizer_states not in STATE_BYTES:
        raise ConfigError(
            f"optimizer states must be one of {', '.join(STATE_BYTES)}; got {optimizer_states!r}"
        )
    adam = STATE_BYTES[optimizer_states]
    optim = adam * n
    if optimizer == "muon":
        hidden = models.hidden_matrices(model)
        optim -= (adam - 4) * sum(p.numel() for p in model.parameters() if id(p) in hidden)
    return optim


def newton_schulz_flops(model: Any, steps: int = 5) -> float:
    """FLOP of one Muon step's Newton-Schulz iteration: per hidden matrix (m <= n; an expert stack counts each
    expert), ``steps`` x (X Xᵀ: 2m²n, A·A: 2m³, B·X: 2m²n)."""
    hidden = models.hidden_matrices(model)
    total = 0.0
    for p in model.parameters():
        if id(p) in hidden:
            m, n = sorted(p.shape[-2:])
            total += math.prod(p.shape[:-2]) * steps * (4 * m * m * n + 2 * m**3)
    return total


def muon_graph_bytes(model: Any) -> float:
    """Muon's step recorded as a CUDA graph (perf.muon_graph) keeps the private memory of its largest batch of
    matrices between steps: ~15 bytes per parameter of that batch (the fp32 updates, their bf16 stack, the
    iteration's products; measured: docs/performance.md). A batch holds at most 2^28 parameters
    (``Muon.chunk_bytes``: 1 GiB of fp32 matrices)."""
    hidden = models.hidden_matrices(model)
    batches: dict[tuple, int] = {}
    for p in model.parameters():
        if id(p) in hidden:
            key = (*p.shape[:-2], *sorted(p.shape[-2:]))  # the shape as Newton-Schulz iterates it
            batches[key] = batches.get(key, 0) + p.numel()
    return 15.0 * min(max(batches.values(), default=0), 1 << 28)


def _place(
    b: _Bytes,
    model: Any,
    n: int,
    tp: int,
    num_gpus: int,
    strategy: str,
    cpu_offload: bool,
    reshard_after_forward: bool,
    accum_unsharded_grads: bool = False,
    grads_beside_activations: bool = False,
) -> str:
    """Spread ``b`` over the GPUs (tensor parallel, FSDP, offload to the host) and set its peak ``total``; returns
    the strategy the figures assume (offload is FSDP's).

    ``cpu_offload`` (FSDP2's CPUOffloadPolicy, on any number of GPUs): the fp32 weights, gradients and optimizer
    state live in host memory (``host_gib``, per process); the GPU holds the gathered bf16 blocks, one block's
    unsharded fp32 gradient before it is reduced and moved out, the logits working set and the activations.

    ``tp`` (tensor parallelism over ``tp`` of the ``num_gpus``; parallel/tp.py): each rank holds ``1/tp`` of the
    blocks' parameters (the embeddings and head whole) and ``1/tp`` of their activations (sequence parallelism
    splits the residual stream and norms, tensor parallelism the heads and MLP units), except what every rank keeps
    whole (``act_whole``: the gathered sub-layer inputs, INL's integrator); FSDP then shards over ``num_gpus / tp``.

    ``reshard_after_forward`` False (FSDP2 keeps every block gathered from its forward to its backward): the
    working set holds every block's bf16 weights instead of two.

    ``accum_unsharded_grads`` (FSDP2 accumulating without a reduce-scatter per micro-batch): every GPU also holds
    its whole fp32 gradient between the micro-batches.
    """
    n_blocks = sum(p.numel() for p in model.layers.parameters())
    # FSDP's working set (offloaded or not): the largest block (DeepSeek's MoE blocks outweigh its dense ones)
    # gathered in bf16 with the next one prefetched, the root (embeddings, final norm, head), and the block's
    # unsharded fp32 gradient in backward.
    block = max(sum(p.numel() for p in layer.parameters()) for layer in model.layers) / tp
    gathered = 2 * (2 * block + (n - n_blocks)) + 6 * block
    if not reshard_after_forward:
        gathered = 2 * (n_blocks / tp + (n - n_blocks)) + 6 * block
    if tp > 1:
        kept = (n - n_blocks + n_blocks / tp) / n  # the share of the parameters a rank holds
        b.weights, b.grads, b.optim, b.copies = (
            b.weights * kept,
            b.grads * kept,
            b.optim * kept,
            b.copies * kept,
        )
        b.act = (b.act + b.act_added - b.act_whole) / tp + b.act_whole
    dp = max(1, num_gpus // tp)
    b.staging = b.weights + b.optim
    if cpu_offload:
        b.host = (b.weights + b.grads + b.optim) / num_gpus
        b.staging = (b.weights + b.optim) / num_gpus
        b.weights, b.grads, b.optim, b.copies = 0.0, 4 * block, 0.0, gathered
        b.total = b.copies + b.grads + b.logits + b.act
        return "fsdp"
    if strategy == "fsdp" and dp > 1:
        kept_whole = b.grads if accum_unsharded_grads else 0.0
        b.weights, b.grads, b.optim, b.copies = (
            b.weights / dp,
            b.grads / dp + kept_whole,
            b.optim / dp,
            gathered,
        )
        b.staging = b.weights + b.optim
        # Sharded gradients are small and fill up while activations are freed: counted in full (conservative).
        b.total = b.weights + b.optim + b.grads + b.copies + b.logits + b.act
        return strategy
    # Two candidate peaks on top of weights and optimizer state: early in backward (all activations, the bf16
    # weight copies autocast saved, the logits working set) or at the optimizer step (all fp32 gradients, the
    # rest freed). Under accumulation the gradients of the micro-batches before are there during the next one's
    # backward, and under CUDA graphs they stay allocated between steps: both at once. The measured peaks these
    # match: docs/performance.md, "Memory and time estimate".
    if grads_beside_activations:
        b.total = b.weights + b.optim + b.grads + b.copies + b.logits + b.act
    else:
        b.total = b.weights + b.optim + max(b.grads, b.copies + b.logits + b.act)
    return strategy


def _meta_model(family: str, size: str, overrides: dict | None) -> tuple[Any, Any]:
    """``(args, model)`` of ``family`` at ``size``, built on the meta device (shapes only, no memory)."""
    import torch

    args = models.model_args(family, size, dict(overrides or {}))
    with torch.device("meta"):
        return args, models.build_model(family, args)


def unsharded_grad_bytes(
    family: str, size: str, overrides: dict | None, tp: int = 1, pp: int = 1, ep: int = 1
) -> float:
    """The fp32 gradient of the parameters one rank holds whole (the blocks split by ``tp`` and ``pp``, the routed
    experts by ``ep``; the embeddings and head counted whole, a slight overestimate under a pipeline)."""
    from gptoughts.models.deepseek.moe import GroupedExperts

    model = _meta_model(family, size, overrides)[1]
    n = model.num_params()
    n_blocks = sum(p.numel() for p in model.layers.parameters())
    experts = sum(
        p.numel() for m in model.layers.modules() if isinstance(m, GroupedExperts) for p in m.parameters()
    )
    return 4.0 * (n - n_blocks + (n_blocks - experts + experts / ep) / (tp * pp))


def default_mfu(d_model: int) -> float:
    """The MFU ``bench`` measured for the size class on Hopper (bench/BENCHMARKS.md)."""
    return 0.55 if d_model >= 2048 else 0.45


def fp8_speedup(d_model: int) -> float:
    """How much faster fp8 (torchao tensorwise) trains than bf16 at 1b and 3b (bench/BENCHMARKS.md, "fp8 on the user
    path"); below d_model 2048 the casts cost about what the matmuls gain (``perf.fp8 = auto`` stays off there), so
    no gain is counted."""
    return 1.2 if d_model >= 2048 else 1.0


def gpu_tokens_per_s(
    peak: float,
    flops_per_token: float,
    mfu: float,
    num_gpus: int,
    tokens_step: int | None = None,
    data_ranks: int = 1,
) -> tuple[float, float]:
    """(tokens/s, the tokens/s FLOPs alone allow) at ``mfu`` of ``peak`` on ``num_gpus``: with ``tokens_step`` (a
    micro-batch's tokens on each of ``data_ranks``), no faster than one such step every :data:`MIN_STEP_S`."""
    flops_tps = peak * mfu / flops_per_token * num_gpus
    tps = min(flops_tps, tokens_step * data_ranks / MIN_STEP_S) if tokens_step else flops_tps
    return tps, flops_tps


def _speed_and_cost(
    gpu: str,
    d_model: int,
    flops_tok: float,
    mfu: float | None,
    num_gpus: int,
    tokens: int | None,
    price: float | None,
    *,
    tokens_step: int | None = None,
    data_ranks: int = 1,
    fp8: bool = False,
) -> dict[str, Any]:
    """Speed at ``mfu`` of ``gpu``'s peak (default by size class), the time for ``tokens`` and its price, and the
    GPU's memory (None for a GPU not in GPU_MEMORY_GIB): the Estimate fields of the same names. With
    ``tokens_step`` (a micro-batch's tokens on each of ``data_ranks``), no faster than one such step every
    :data:`MIN_STEP_S`. ``fp8``: the bf16 peak's MFU times :func:`fp8_speedup` (an MFU-equivalent)."""
    peak = peak_flops(gpu)
    if peak is None and gpu.lower() in ("cpu", "mps"):
        raise _not_a_gpu(gpu.lower())
    if peak is None:
        raise ConfigError(f"unknown GPU {gpu!r}; known: {', '.join(sorted(_PEAK_BF16))}")
    if mfu is None:
        mfu = default_mfu(d_model) * (fp8_speedup(d_model) if fp8 else 1.0)
    tps, flops_tps = gpu_tokens_per_s(peak, flops_tok, mfu, num_gpus, tokens_step, data_ranks)
    hours = tokens / tps / 3600 if tokens else None
    # by whole words ("L40" is not an "L4"); a size in the name ("A100 40GB", "NVIDIA A100-SXM4-40GB") is the card's
    key = match_gpu(gpu, GPU_MEMORY_GIB)
    stated = re.search(r"(?<![0-9])([0-9]+) ?gb(?![a-z])", gpu.lower())
    pph = price if price is not None else DEFAULT_PRICE.get(key) if key else None
    return {
        "gpu_memory_gib": _memory_gib(key, stated),
        "flops_per_token": flops_tok,
        "mfu": mfu,
        "tokens_per_s": tps,
        "flops_tokens_per_s": flops_tps,
        "tokens": tokens,
        "hours": hours,
        "price_per_hour": pph,
        "cost": (hours * pph * num_gpus) if (hours is not None and pph is not None) else None,
    }


def _not_a_gpu(device: str) -> ConfigError:
    """The refusal of an estimate for a CPU or an Apple GPU: a CPU's speed is measured, not looked up (train's dry run
    times a matmul there and plans with it)."""
    return ConfigError(
        f"gptoughts estimate models GPUs, not {device}: for this machine, `gptoughts train` with the same flags "
        f"and --device {device} --dry_run prints the plan (memory, and time from a matmul timed here)"
    )


# Bytes per parameter of AdamW's two moments, by ``train.optimizer_states`` (training/optim.py builds them). 8bit:
# torchao's OptimState8bit, one uint8 code per value and one fp32 scale per block of 256 (tensors under 4096
# values, or not a multiple of 256, stay fp32: norms and biases, a negligible share).
STATE_BYTES = {"fp32": 8.0, "bf16": 4.0, "8bit": 2 * (1 + 4 / 256)}


def _memory_gib(key: str | None, stated: Any) -> float | None:
    """A GPU's memory: the size its name states ("A100 40GB"), never above its table's (a "GH200 480GB" names the
    whole superchip's memory), else the table's."""
    table = GPU_MEMORY_GIB.get(key) if key else None
    if stated is None:
        return table
    return min(int(stated.group(1)), table) if table else int(stated.group(1))


def duration(hours: float | None) -> str:
    """A run's time as a person reads it: seconds, minutes, or hours (and days beyond two), as the plan prints it."""
    if hours is None:
        return "?"
    if hours < 1 / 60:
        return f"{hours * 3600:.0f} s"
    if hours < 1:
        return f"{hours * 60:.0f} min"
    return f"{hours:,.1f} h" + (f" ({hours / 24:.1f} days)" if hours > 48 else "")


def format_estimate(e: Estimate) -> str:
    lines = [
        f"{e.params / 1e6:,.1f}M params ({e.params_non_embedding / 1e6:,.1f}M non-embedding), "
        + (
            f"{e.flops_per_token / 1e9:.2f} GFLOP/token"
            if e.flops_per_token >= 1e7
            else f"{e.flops_per_token / 1e6:.1f} MFLOP/token"  # a debug model's 0.004 GFLOP is not "0.00"
        ),
        "memory at peak (GiB):",
    ]
    for k in ("weights", "gradients", "optimizer", "autocast_copies", "activations", "logits"):
        label = "fsdp_gathered" if k == "autocast_copies" and e.strategy == "fsdp" else k
        if k == "optimizer" and e.optimizer_states != "fp32":
            label = f"optimizer ({e.optimizer_states})"  # the moments' storage the figure assumes
        lines.append(f"  {label:<16} {getattr(e, k + '_gib'):8.2f}")
    fit = "" if e.fits is None else ("  fits" if e.fits else "  DOES NOT FIT")
    mem = f" of {e.gpu_memory_gib} on {e.gpu}" if e.gpu_memory_gib else ""
    lines.append(f"  {'total':<16} {e.total_gib:8.2f}{mem}{fit}")
    if e.host_gib:
        lines.append(f"  {'host (offload)':<16} {e.host_gib:8.2f} of CPU memory per process")
    floored = (
        e.tokens_per_s is not None
        and e.flops_tokens_per_s is not None
        and e.tokens_per_s < e.flops_tokens_per_s
    )
    if e.tokens_per_s is None:
        lines.append(
            "speed: not estimated under CPU offload (host-device copies and the CPU's optimizer step bound it, not "
            "the GPU's FLOPs): measured once the run starts"
        )
    elif floored:
        lines.append(
            f"speed: at most {e.tokens_per_s:,.0f} tokens/s on {e.gpu}: a model this small is bound by each step's "
            f"~{MIN_STEP_S * 1e3:g} ms of kernel launches, not by its FLOPs (at MFU {e.mfu:.2f} they would allow "
            f"{e.flops_tokens_per_s:,.0f}); `gptoughts bench` with the same flags measures it"
        )
    else:
        lines.append(f"speed: {e.tokens_per_s:,.0f} tokens/s at MFU {e.mfu:.2f} on {e.gpu}")
    if e.hours is not None:
        # cents where the whole is a few dollars (a short run's cost printed "$0")
        c = e.cost or 0.0
        dollars = f"${c:,.0f}" if c >= 100 else f"${c:.2f}" if c >= 0.01 else "under $0.01"
        cost = f", {dollars} at ${e.price_per_hour}/h per GPU" if e.cost is not None else ""
        least = "at least " if floored else ""
        lines.append(f"time for {e.tokens:,} tokens: {least}{duration(e.hours)}{cost}")
    return "\n".join(lines)


def _check_layout(cfg: Any, num_gpus: int, args: Any) -> str:
    """The refusals ``gptoughts train`` makes of this layout on ``num_gpus`` GPUs, made here as one line: figures for
    a split the GPUs cannot take (``--parallel.tp 2`` on one GPU) or the model cannot (DeepSeek under tensor
    parallelism, 64 experts over 3 ranks) answered a question that train refuses. Returns the strategy the launch
    takes (``parallel/dist.py``'s ``init``: FSDP2 for offload, experts, or tensor parallelism beside data
    parallelism; ``auto`` otherwise DDP)."""
    from gptoughts.parallel import pp as pipeline
    from gptoughts.parallel.dist import _with_tp, check_layout
    from gptoughts.parallel.ep import check_ep
    from gptoughts.parallel.tp import check_tp

    par, family = cfg.parallel, models.get_family(cfg.model.family)
    for name in ("tp", "pp", "ep"):  # (config validation refused any two of them together)
        split = getattr(par, name)
        if num_gpus % split:
            raise ConfigError(
                f"--parallel.{name} {split} splits the run over groups of {split} GPUs, which --num_gpus "
                f"{num_gpus} does not divide; pass --num_gpus a multiple of {split}"
            )
    check_tp(family.name, args, par.tp, lora=cfg.lora.enabled)
    check_ep(family.name, args, par.ep, lora=cfg.lora.enabled)
    if par.pp > 1:
        pipeline.check_supported(
            family.name, args, lora=cfg.lora.enabled, generic=False, objective=family.objective
        )
    dp = num_gpus // (par.tp * par.pp)
    check_layout(par.strategy, par.cpu_offload, par.tp, par.pp, dp)
    if par.pp > 1:  # the plan prints "memory: not estimated" for a pipeline: no figure here either
        raise ConfigError(
            f"gptoughts estimate does not model pipeline stages (--parallel.pp {par.pp}): drop --parallel.pp to "
            "estimate the whole model on each GPU, or use --parallel.strategy fsdp over the same GPUs"
        )
    if par.cpu_offload or par.ep > 1:
        return "fsdp"
    return "fsdp" if _with_tp(par.strategy, par.tp, dp) == "fsdp" else "ddp"


def run_tokens(cfg: Any, tokens_per_step: int, tokens: int | None) -> int | None:
    """The tokens the run trains, which its time and cost are of: ``--tokens``, else those of the stopping rule
    train plans (``batches._total_steps``: ``max_steps`` steps, ``max_tokens`` rounded up to whole steps); None
    for an epoch rule (its corpus is not read here). ``--tokens`` beside a stopping rule the user named (a flag, the
    preset or file) is refused: the estimate would time another run than train's."""
    t = cfg.train
    rule = next((k for k in ("max_steps", "max_tokens", "epochs") if cfg.is_given(f"train.{k}")), None)
    if tokens is not None and rule is not None:
        value = getattr(t, rule)
        if f"train.{rule}" in cfg.flags or cfg.origin is None:
            raise ConfigError(
                f"--tokens and --{rule} {value} both set the run's length: drop --tokens (the estimate times the "
                f"run --{rule} makes), or drop --{rule}"
            )
        raise ConfigError(
            f"--tokens asks for another length than the {rule} {value} in {cfg.origin}, which train runs: drop "
            f"--tokens (the estimate times that run)"
        )
    if tokens is not None:
        return tokens
    if t.max_steps is not None:
        return t.max_steps * tokens_per_step
    if t.max_tokens is not None:
        return math.ceil(t.max_tokens / tokens_per_step) * tokens_per_step
    return None


def estimate_config(
    cfg: Any,
    *,
    gpu: str = "H100",
    num_gpus: int = 1,
    tokens: int | None = None,
    mfu: float | None = None,
    price: float | None = None,
) -> tuple[Estimate, int, int]:
    """The estimate of the run ``cfg`` describes (the same config ``gptoughts train`` resolves from the same
    flags): its family, size, overrides, block, activation checkpointing, residual dtype, strategy, and the
    vocabulary its tokenizer spec gives. Decided in train's order (``training/build.py``): the memory layout first
    (``perf/layout.py``: checkpointing, optimizer states, offload among the settings left to their defaults, at
    the batch given or, for ``batch_size = auto``, one row), then ``batch_size = auto``'s micro-batch, the largest
    power of two whose estimate fits 90% of ``gpu``'s memory, accumulated to ``train.global_batch_tokens`` as
    train does. Returns ``(estimate, micro_batch, grad_accum)``; the estimate's ``layout`` says what the chooser
    changed and why, its ``refusal`` the line train refuses the run with (host memory is not checked here)."""
    import importlib.util

    from gptoughts.parallel.dist import DistInfo
    from gptoughts.perf.autobatch import accumulation_for, global_batch_shape
    from gptoughts.perf.layout import Layout, LayoutSearch, Need, fixed_layout, gib_figure

    t, p, par = cfg.train, cfg.perf, cfg.parallel
    device = str(p.device).split(":")[0].lower()
    if device in ("cpu", "mps"):  # train would run there, not on --gpu
        raise _not_a_gpu(device)
    overrides = dict(cfg.model.overrides)
    spec = str(cfg.data.tokenizer)
    if "vocab_size" not in overrides and spec.startswith("bpe:"):
        overrides["vocab_size"] = -(-int(spec.split(":")[1]) // 64) * 64
    elif "vocab_size" not in overrides and spec == "bytes":
        overrides["vocab_size"] = 320
    residual = "fp32" if p.residual_dtype == "fp32" else "bf16"
    loss = "plain" if p.loss == "plain" else "chunked"

    args = models.model_args(cfg.model.family, cfg.model.size, dict(overrides))
    strategy = _check_layout(cfg, num_gpus, args)
    data_ranks = max(1, num_gpus // par.tp)

    def accum_at(
        batch: int,
    ) -> int:  # as plan_batches sets it: the user's --grad_accum, else the global batch's
        if isinstance(t.batch_size, int) or not t.global_batch_tokens or cfg.is_given("train.grad_accum"):
            return t.grad_accum
        return accumulation_for(t.global_batch_tokens, batch, t.block_size, data_ranks)

    cap = p.gpu_memory_gib  # the memory a run may fill (--gpu_memory_gib), where the user caps it
    # torchao's float8 linears, as the run resolves perf.fp8 on this GPU (auto: hardware.fp8_auto)
    arch = arch_of(gpu)
    fp8 = (
        p.fp8 == "auto"
        and arch is not None
        and fp8_auto(arch, args.d_model, p.fp8_recipe)[0]
        or p.fp8 is True
    ) and p.fp8_recipe != "fused_rowwise"
    start = Layout(resolve_ac(p.activation_checkpointing, cfg.lora)[0], t.optimizer_states, par.cpu_offload)

    def at(batch: int, layout: Layout = start, run: int | None = None) -> Estimate:
        e = estimate(
            cfg.model.family,
            cfg.model.size,
            overrides,
            batch_size=batch,
            block_size=t.block_size,
            activation_checkpointing=layout.activation_checkpointing,
            loss=loss,
            loss_chunk=p.loss_chunk,
            gpu=gpu,
            tokens=run,
            mfu=mfu,
            price=price,
            num_gpus=num_gpus,
            residual_dtype=residual,
            strategy="fsdp" if layout.cpu_offload else strategy,
            optimizer=t.optimizer,
            optimizer_states=layout.optimizer_states,
            cpu_offload=layout.cpu_offload,
            tp=par.tp,
            grad_accum=accum_at(batch),
            fp8=fp8,
        )
        if cap and (e.gpu_memory_gib is None or cap < e.gpu_memory_gib):
            e = replace(e, gpu_memory_gib=cap, fits=e.total_gib <= cap * 0.95)
        return e

    micro, accum = t.batch_size, t.grad_accum
    first = at(micro if isinstance(micro, int) else 1)
    layout, why, refusal = start, {}, None
    if first.gpu_memory_gib:
        # train's choice (training/estimates.py layout_search), on the launch this estimate describes
        dist = DistInfo(world_size=num_gpus, strategy=strategy, tp=par.tp, cpu_offload=par.cpu_offload)
        shape = micro if isinstance(micro, int) else 1
        search = LayoutSearch(
            start=start,
            measure=lambda lay: Need((e := at(shape, lay)).total_gib, e.host_gib),
            gpu_gib=first.gpu_memory_gib,
            host_gib=None,
            what=f"{cfg.model.family}/{cfg.model.size}",
            where=f"the {gib_figure(cap)} of --gpu_memory_gib"
            if cap and cap == first.gpu_memory_gib
            else f"the {gpu}'s {gib_figure(first.gpu_memory_gib)}",
            shape=f"micro-batch {shape} x {t.block_size:,} tokens",
            fixed=fixed_layout(cfg, dist),
            eight_bit=importlib.util.find_spec("torchao") is not None
            and t.optimizer == "adamw"
            and not dist.sharded,
        )
        choice = search.choose()
        layout, why, refusal = choice.layout, choice.why, choice.refusal
    if not isinstance(micro, int):
        micro = 1
        if first.gpu_memory_gib:
            for b in (2, 4, 8, 16, 32, 64, 128, 256):
                if at(b, layout).total_gib > 0.9 * first.gpu_memory_gib:
                    break
                micro = b
        if t.global_batch_tokens and not cfg.is_given("train.grad_accum"):
            micro, accum = global_batch_shape(t.global_batch_tokens, micro, t.block_size, data_ranks)
    e = at(micro, layout, run_tokens(cfg, micro * accum * t.block_size * data_ranks, tokens))
    return replace(e, layout=why, refusal=refusal), micro, accum
