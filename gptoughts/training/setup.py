"""Building the model that the trainer runs: the one place where transforms are applied, in one order.

Order (each step only if configured): build on the meta device → materialise on the target device and
initialise (or load) weights → residual-stream dtype (an embedding hook) → fp8 conversion → pipeline split
(this rank's stages; every later step applies to each stage) → tensor parallel → activation checkpointing →
compile → FSDP / DDP → optimizer. Model code stays single-device; everything here wraps or converts it.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from gptoughts import models
from gptoughts.config import LoraConfig, ParallelConfig, PerfConfig, TrainConfig
from gptoughts.errors import ConfigError, HardwareError, UserError
from gptoughts.models import layers
from gptoughts.parallel import dist as pdist
from gptoughts.perf import checkpointing
from gptoughts.perf.hardware import HardwareProfile
from gptoughts.sampling import uncompiled


@dataclass
class Built:
    model: nn.Module
    """What the trainer calls (possibly compiled and/or DDP-wrapped)."""
    raw: nn.Module
    """The plain module (for state dicts, generation and export)."""
    forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    """Entered around every forward/backward (SDPA backend selection)."""
    resolved: dict[str, object] = field(default_factory=dict)
    """What each ``auto`` became, for the run record and bench output."""
    why: dict[str, str] = field(default_factory=dict)
    """The rule that decided each entry of ``resolved`` ("asked", or the ``auto`` rule that applied)."""
    after_optimizer_step: Callable[[], None] | None = None
    """Run by the trainer after each optimizer step (fp8 all-gather: the next step's weight scales)."""
    pipeline: Any = None
    """``parallel.pp.Pipeline`` under pipeline parallelism (``model`` is then its ``RankModel``), else None."""
    per_block: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    """Under whole-model compile: the context in which the model runs its per-block compiled graphs (the
    auto-batch probe's steps; evaluations enter it through ``forward_context``). Else a no-op."""
    whole_model: list[nn.Module] = field(default_factory=list)
    """The modules compiled whole, their blocks compiled too (the per-block graphs); [] under per-block compile."""
    whole_model_auto: bool = False
    """``compile_mode = auto`` chose the whole model: the assembly keeps it only for a long enough run."""
    keep_grads: bool = False
    """CUDA graphs: gradients stay allocated between steps (zeroed, not freed), so that each backward adds into
    them in place. Freed, the first backward of a step would hand its graph's static output buffer over as
    ``.grad``, and the next micro-batch's replay would overwrite it ("accessing tensor output of CUDAGraphs that
    has been overwritten by a subsequent run" under gradient accumulation). A trainable parameter that gets no
    gradient in a step then has a zero one, and AdamW decays it (every parameter of our families gets a gradient
    in every step; checked at debug size)."""

    def use_per_block(self, why: str) -> None:
        """Train on the per-block graphs instead of the whole-model one (``why``: the rule that decided). Nothing
        compiled is lost: the whole-model graph is compiled at the first training step, the blocks' already are."""
        for part in self.whole_model:
            part._compiled_call_impl = None  # Module.compile's slot; None is the plain call (compiled blocks)
        self.whole_model, self.whole_model_auto = [], False
        self.per_block = contextlib.nullcontext
        self.resolved["compile"] = "blocks"
        self.why["compile"] = self.why.get("compile", "").split("; ")[0] + f"; blocks: {why}"


def build_raw_model(family: str, args: object, device: torch.device, seed: int) -> nn.Module:
    """Meta-device build, then allocate on ``device`` and initialise from ``seed`` (no wasted CPU init)."""
    with torch.device("meta"):
        model = models.build_model(family, args)
    model.to_empty(device=device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        model.init_weights()
    return model


# The one rule of each `auto` of [perf] that depends on the hardware or the model: (value, why). The run plan and
# run.json show both ("compile": "blocks (auto: on for CUDA GPUs)").


def compile_rule(perf: PerfConfig, hw: HardwareProfile) -> tuple[bool, str]:
    if perf.compile == "auto":
        on = bool(hw.recommended.get("compile")) and hw.arch not in ("cpu", "mps")
        return on, "auto: on for CUDA GPUs" if on else f"auto: off on {hw.arch} (tiny graphs, long compiles)"
    if perf.compile and not hw.compile:
        raise HardwareError(
            "--compile needs a working torch.compile backend (a C compiler on CPU, Triton on GPU);"
            " install one or drop --compile"
        )
    return bool(perf.compile), "asked"


# Whole-model compile beats per-block compile by a few % tokens/s on the user's path, for ~20-25 s more compile
# at the first step (measured: docs/performance.md, "Compile and CUDA graphs"); CUDA graphs on top gain nothing
# at pretraining's auto batch: cuda_graphs_rule keeps them for LoRA.
WHOLE_MODEL_MIN_RUN_S = 1200
"""``compile_mode = auto`` keeps the whole model for runs estimated at least this long (break-even: ~8 min at
125m, ~19 min at gpt2 small)."""
WHOLE_MODEL_MAX_PARAMS = 400_000_000
"""``compile_mode = auto`` compiles the whole model up to this many non-embedding parameters (one process)."""
_WHOLE_MODEL_FAMILIES = ("llama", "gpt2")


def cuda_graphs_rule(
    perf: PerfConfig,
    compiled: bool,
    family: str,
    lora: LoraConfig | None,
    dist: pdist.DistInfo,
    device: torch.device,
    precision: str = "bf16",
    auto_batch: bool = False,
) -> tuple[bool, str]:
    """What ``perf.cuda_graphs`` becomes, and why. ``auto``: on for LoRA adapters over a Llama base that is not
    4-bit (QLoRA), compiled, in one CUDA process, in bf16 or fp32 (fp16's loss scaler was not measured with them),
    at a given micro-batch (``--batch_size auto`` probes sizes with real steps, each of which would record graphs:
    not measured). A LoRA step is short and launches many small kernels (the adapters' skinny matmuls, the
    dropout bits), so replaying it as CUDA graphs measured 1.06-1.2x faster at 1b (docs/performance.md, "Compile
    and CUDA graphs"). Pretraining's auto batch makes steps long enough that graphs gain nothing there, and other
    families, QLoRA's 4-bit matmuls and several processes were not measured with them: off."""
    if perf.cuda_graphs != "auto":
        return bool(perf.cuda_graphs), "asked"
    one_process = not dist.enabled and not dist.sharded
    if compiled and device.type == "cuda" and family == "llama" and one_process and precision != "fp16":
        if lora is not None and lora.enabled and lora.quantize == "none" and not auto_batch:
            return True, "auto: LoRA in one process, whose short steps wait on kernel launches"
    return False, "auto"


def compile_mode_rule(
    perf: PerfConfig,
    compiled: bool,
    raw: nn.Module,
    family: str,
    dist: pdist.DistInfo,
    device: torch.device,
) -> tuple[str, str]:
    """What ``perf.compile_mode`` becomes (blocks or model), and why."""
    if perf.compile_mode != "auto":
        return perf.compile_mode, "asked"
    if not compiled:
        return "blocks", "auto: not compiled"
    if device.type != "cuda":
        return "blocks", f"auto: per-block on {device.type} (whole-model compile measured on GPUs)"
    if dist.world_size > 1 or dist.sharded:
        return "blocks", "auto: per-block under several processes or offload"
    if family not in _WHOLE_MODEL_FAMILIES:
        return (
            "blocks",
            f"auto: per-block for {family or 'this model'} (whole-model compile measured on llama)",
        )
    if any(not p.requires_grad for p in raw.parameters()):
        return "blocks", "auto: per-block with frozen weights (LoRA: whole-model compile measured no faster)"
    n = raw.num_params(non_embedding=True)  # llama and gpt2: our DecoderLM
    if n > WHOLE_MODEL_MAX_PARAMS:
        return "blocks", f"auto: per-block above {WHOLE_MODEL_MAX_PARAMS / 1e6:.0f}M non-embedding parameters"
    return (
        "model",
        f"auto: whole model at {n / 1e6:.0f}M non-embedding parameters (3-6% faster steps below 400M)",
    )


def fp8_rule(perf: PerfConfig, hw: HardwareProfile, model: nn.Module) -> tuple[bool, str]:
    if perf.fp8 == "auto":
        d_model = getattr(getattr(model, "args", None), "d_model", 0)
        if hw.arch not in ("hopper", "blackwell"):
            return False, f"auto: off on {hw.arch} (fp8 pays on Hopper and later)"
        if d_model < 2048:
            return False, f"auto: off at d_model {d_model} < 2048 (the casts cost more than the matmuls gain)"
        try:
            import torchao  # noqa: F401
        except ImportError:
            return False, "auto: off, torchao is not installed (pip install 'gptoughts[fp8]')"
        return True, "auto: Hopper+, d_model >= 2048, torchao present"
    return bool(perf.fp8), "asked"


def resolve_loss(perf: PerfConfig, device: torch.device) -> str:
    if perf.loss != "auto":
        if perf.loss == "liger":
            try:
                import liger_kernel  # noqa: F401
            except ImportError:
                raise UserError("perf.loss = liger needs liger-kernel: pip install liger-kernel") from None
        return perf.loss
    return "chunked" if device.type == "cuda" else "plain"


_SDPA = {
    "flash": "FLASH_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}


def sdpa_context(backend: str) -> Callable[[], contextlib.AbstractContextManager]:
    if backend not in _SDPA:  # auto, and fa4: what FA4 does not take goes to SDPA's own choice
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = getattr(SDPBackend, _SDPA[backend])
    return lambda: sdpa_kernel([chosen])


def check_attention(perf: PerfConfig, device: torch.device) -> None:
    """Refuse, before anything is built or written, an attention kernel this machine cannot run."""
    from gptoughts.perf import attention

    if perf.sdpa_backend == "fa4":
        why = attention.fa4_unavailable(device)
        if why is not None:
            raise UserError(f"perf.sdpa_backend = fa4: {why}; or use --perf.sdpa_backend auto")
    if perf.doc_mask_attention == "flex":
        why = attention.flex_unavailable(device)
        if why is not None:
            raise UserError(f"perf.doc_mask_attention = flex: {why}; use auto or sdpa")


def attention_rule(
    perf: PerfConfig, device: torch.device
) -> tuple[layers.AttentionKernels, dict[str, str], dict[str, str]]:
    """The kernels ``layers.sdpa`` routes to; what ``sdpa_backend`` and ``doc_mask_attention`` became, and why.

    FA4 measured faster than cuDNN's SDPA, so ``auto`` takes it wherever flash-attn-4 is installed and runs;
    FlexAttention was faster on packed rows but failed in a 350m SFT run, so ``auto`` keeps the dense mask and
    flex stays a switch (measurements: docs/performance.md, "Attention kernels")."""
    from gptoughts.perf import attention

    check_attention(perf, device)
    backend, backend_why = perf.sdpa_backend, "asked"
    if backend == "auto" and device.type == "cuda":
        missing = attention.fa4_unavailable(device)
        if missing is None:
            backend, backend_why = (
                "fa4",
                "auto: FlashAttention-4 installed (measured faster than SDPA on Hopper)",
            )
        else:
            backend_why = "auto: SDPA's choice (flash-attn-4 not usable here)"
    fa4 = attention.FA4() if backend == "fa4" else None
    doc, doc_why = perf.doc_mask_attention, "asked"
    if doc == "auto":
        doc, doc_why = (
            "sdpa",
            "auto: dense mask (flex is faster but failed in a GPU run; --perf.doc_mask_attention flex)",
        )
    flex = attention.FlexDocAttention(compiled=device.type == "cuda") if doc == "flex" else None
    resolved = {"sdpa_backend": backend, "doc_mask_attention": doc}
    return (
        layers.AttentionKernels(fa4=fa4, doc=flex),
        resolved,
        {"sdpa_backend": backend_why, "doc_mask_attention": doc_why},
    )


def inductor_mode(perf: PerfConfig) -> str | None:
    """torch.compile ``mode`` for the perf switches (None: the default mode)."""
    return {
        (False, False): None,
        (True, False): "reduce-overhead",
        (False, True): "max-autotune-no-cudagraphs",
        (True, True): "max-autotune",
    }[(perf.cuda_graphs is True, bool(perf.max_autotune))]  # "auto" is resolved by cuda_graphs_rule first


def _residual_to_bf16(module: nn.Module, args: object, out: torch.Tensor) -> torch.Tensor:
    dev = out.device.type
    if (
        out.is_floating_point()
        and torch.is_autocast_enabled(dev)
        and torch.get_autocast_dtype(dev) == torch.bfloat16
    ):
        return out.to(torch.bfloat16)
    return out


def set_residual_dtype(model: nn.Module, residual_dtype: str) -> int:
    """``bf16``: cast the output of the input embeddings (every ``nn.Embedding`` outside the blocks) to bf16
    under bf16 autocast, so the residual stream, the activations saved for backward and their gradients are
    bf16. Returns the number of embeddings hooked (a no-op outside bf16 autocast)."""
    if residual_dtype == "fp32":
        return 0
    inside = {id(m) for m in model.layers.modules()}
    n = 0
    for m in model.modules():
        if isinstance(m, nn.Embedding) and id(m) not in inside:
            m.register_forward_hook(_residual_to_bf16)
            n += 1
    return n


def _forward_context(
    perf: PerfConfig,
    kernels: layers.AttentionKernels | None = None,
    per_block: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> Callable[[], contextlib.AbstractContextManager]:
    sdpa = sdpa_context(perf.sdpa_backend)
    kernels = kernels or layers.AttentionKernels()
    if not perf.cuda_graphs and kernels == layers.AttentionKernels() and per_block is None:
        return sdpa

    @contextlib.contextmanager
    def ctx():
        training = torch.is_grad_enabled()
        if perf.cuda_graphs:
            # Each forward starts a new CUDA-graph "iteration": the previous one's outputs were consumed by its
            # backward (or are eval outputs), so their static buffers may be reused.
            torch.compiler.cudagraph_mark_step_begin()
        with contextlib.ExitStack() as stack:
            stack.enter_context(sdpa())
            stack.enter_context(layers.use_attention_kernels(kernels))
            if per_block is not None and not training:  # evaluations: the per-block graphs (apply_transforms)
                stack.enter_context(per_block())
            yield

    return ctx


def apply_transforms(
    raw: nn.Module,
    *,
    perf: PerfConfig,
    hw: HardwareProfile,
    device: torch.device,
    dist: pdist.DistInfo,
    precision: str = "fp32",
    parallel: ParallelConfig | None = None,
    family: str = "",
    lora: LoraConfig | None = None,
    auto_batch: bool = False,
) -> Built:
    resolved: dict[str, object] = {}
    why: dict[str, str] = {}
    # 0. precision of the residual stream (a hook on the embeddings; model code untouched)
    residual = perf.residual_dtype
    why["residual_dtype"] = "asked"
    if residual == "auto":
        residual = str(hw.recommended.get("residual_dtype", "fp32"))
        why["residual_dtype"] = (
            f"auto: {residual} on {hw.arch} (bf16 where the GPU has it; acts under bf16 only)"
        )
    if set_residual_dtype(raw, residual):
        resolved["residual_dtype"] = residual
    # 1. fp8 (before compile, so the compiled graph contains the fp8 casts and can fuse them)
    use_fp8, why["fp8"] = fp8_rule(perf, hw, raw)
    if use_fp8:
        from gptoughts.perf.fp8 import check_fp8_supported, convert_to_fp8

        check_fp8_supported(device)
        gather = perf.fp8_all_gather and dist.strategy == "fsdp"
        resolved["fp8_linears"] = convert_to_fp8(
            raw, perf.fp8_recipe, perf.fp8_bf16_end_layers, gather, perf.fp8_fast_accum
        )
        resolved["fp8"] = perf.fp8_recipe
        if perf.fp8_fast_accum:
            resolved["fp8_fast_accum"] = True
        if perf.fp8_all_gather:
            resolved["fp8_all_gather"] = gather
            why["fp8_all_gather"] = "asked" if gather else "asked, but only FSDP all-gathers weights: off"
    else:
        resolved["fp8"] = False
    # 1b. pipeline split: this rank's stages (after fp8, which swaps modules in place: the stages share them);
    # each of the following transforms applies to every stage
    parts, stage_ids, n_stages = [raw], [0], 1
    if dist.pp > 1:
        from gptoughts.parallel import pp

        par = parallel or ParallelConfig()
        n_stages = pp.stages_of(dist.pp, par.pp_schedule)
        split = pp.split_layers(len(raw.layers), n_stages, par.pp_layers)
        stage_ids = [s for s in range(n_stages) if s % dist.pp == dist.pp_rank]
        parts = [pp.make_stage(raw, split[s], first=s == 0, last=s == n_stages - 1) for s in stage_ids]
    # 2. tensor parallel (+ sequence parallel) over the mesh's tp dimension; build_model ran check_tp before
    # (tensor and pipeline parallelism do not combine: config.check_parallel)
    if dist.tp > 1:
        from gptoughts.parallel.tp import apply_tp

        apply_tp(raw, dist.mesh["tp"], family)
    # 3. activation checkpointing, inside the compiled region
    ac, why["activation_checkpointing"] = checkpointing.resolve(perf.activation_checkpointing, lora)
    for part in parts:
        checkpointing.apply_activation_checkpointing(part, ac)
    resolved["activation_checkpointing"] = ac
    # 4. compile
    compiled, why["compile"] = compile_rule(perf, hw)
    compile_mode, mode_why = compile_mode_rule(perf, compiled, raw, family, dist, device)
    if compiled:
        why["compile"] += f"; {compile_mode}: {mode_why}"
    graphs, graphs_why = cuda_graphs_rule(perf, compiled, family, lora, dist, device, precision, auto_batch)
    perf = replace(perf, compile_mode=compile_mode, cuda_graphs=graphs)
    resolved["compile"] = compile_mode if compiled else False
    if compiled and graphs:
        resolved["cuda_graphs"] = True
        if graphs_why != "asked":
            why["cuda_graphs"] = graphs_why
    # Whole-model compile in a replicated run also compiles each block: evaluations (no_grad) and the auto-batch
    # probe run the per-block graphs (Built.per_block), so the whole model is compiled once, for training, at
    # the run's batch shape (each probe's batch would recompile it: +94 s to the first step at 125m; an
    # evaluation would compile a whole-model inference graph, and record CUDA graphs for it).
    per_block = compiled and compile_mode == "model" and dist.pp == 1 and not dist.sharded
    if compiled:
        mode = inductor_mode(perf)
        if mode:
            resolved["inductor_mode"] = mode
        for part in parts:
            if compile_mode == "blocks" or per_block:
                # Module.compile() compiles in place, so parameter names (and checkpoints) are unchanged.
                # Per-block compile keeps compile time flat in depth; the blocks are identical, so one graph
                # is reused. Under whole-model compile these graphs serve evaluations and the probe (without
                # CUDA graphs, which replay the whole model's): dynamo inlines them when it traces the whole model.
                block_mode = (
                    mode if compile_mode == "blocks" else inductor_mode(replace(perf, cuda_graphs=False))
                )
                for block in part.layers:
                    block.compile(mode=block_mode)
            if compile_mode == "model":
                part.compile(mode=mode)
    elif perf.cuda_graphs or perf.max_autotune:
        raise ConfigError(
            "perf.cuda_graphs and perf.max_autotune are torch.compile modes: add --compile true "
            "(or drop them)"
        )
    whole = list(parts) if per_block else []  # the compiled modules themselves, not their DDP wrappers
    # 5. data parallel: DDP, or FSDP2 (each compiled block sharded in place), over the data-parallel ranks
    parts = [pdist.wrap(part, device, dist, precision) for part in parts]
    model: nn.Module = parts[0]
    if dist.enabled or dist.sharded:
        dp = (
            f"{dist.strategy} x{dist.dp_size}"
            if dist.strategy == "fsdp" or dist.tp == 1
            else f"dp x{dist.dp_size}"
        )
        resolved["parallel"] = (
            dp
            + (f", tp x{dist.tp}" if dist.tp > 1 else "")
            + (f", pipeline x{dist.pp}" if dist.pp > 1 else "")
            + (" + cpu offload" if dist.cpu_offload else "")
        )
    pipeline = None
    if dist.pp > 1:
        bf16_stream = resolved.get("residual_dtype") == "bf16" and precision == "bf16"
        pipeline = pp.Pipeline(
            parts,
            stage_ids,
            n_stages,
            info=dist,
            device=device,
            schedule=par.pp_schedule,
            hidden_loss=_no_loss,  # the objective's, set by make_objective
            hidden_dim=int(raw.args.d_model),
            hidden_dtype=torch.bfloat16 if bf16_stream else torch.float32,
        )
        model = pipeline.view
        # The whole model was built on every rank (the weights of a one-process run); what this rank's stages do not
        # hold (or, under FSDP, hold as shards of their own) is now dead weight: the rest of `raw` goes to the meta
        # device, keeping shapes and names (parameter counts, the plan, the optimizer's order of parameters).
        live = {id(t) for part in parts for t in itertools.chain(part.parameters(), part.buffers())}
        dead: dict[int, torch.Tensor] = {}
        for module in raw.modules():  # `raw`'s own module objects: the stages' are copies
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if t is not None and id(t) not in live:
                        if id(t) not in dead:
                            meta = torch.empty_like(t, device="meta")
                            dead[id(t)] = (
                                nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
                            )
                        table[name] = dead[id(t)]
    resolved["loss"] = resolve_loss(perf, device)
    why["loss"] = (
        "asked" if perf.loss != "auto" else "auto: chunked on CUDA (no fp32 logits of the whole batch)"
    )
    kernels, chosen, reasons = attention_rule(perf, device)
    resolved.update(chosen)
    why.update(reasons)
    after = None
    if use_fp8 and resolved.get("fp8_all_gather"):
        from gptoughts.perf.fp8 import precompute_scales

        def after() -> None:
            for part in parts:  # a pipeline's stages (raw's other tensors are on the meta device there)
                precompute_scales(part)

    # Under whole-model compile, each part's own compiled call set aside: its plain call runs the blocks, each
    # compiled in place (the per-block graphs).
    per_block_ctx = functools.partial(uncompiled, whole) if per_block else contextlib.nullcontext
    return Built(
        model=model,
        raw=raw,
        forward_context=_forward_context(perf, kernels, per_block_ctx if per_block else None),
        per_block=per_block_ctx,
        resolved=resolved,
        why=why,
        after_optimizer_step=after,
        pipeline=pipeline,
        whole_model=whole,
        # asked CUDA graphs replay the whole-model graph (the blocks' are compiled without): kept for any length
        whole_model_auto=per_block and mode_why.startswith("auto") and not perf.cuda_graphs,
        keep_grads=compiled and bool(perf.cuda_graphs),
    )


def _no_loss(*args: object) -> torch.Tensor:
    raise RuntimeError("the pipeline's loss is set by make_objective")


def make_objective(family: models.Family, built: Built, perf: PerfConfig) -> Callable:
    from gptoughts.perf.ce import make_loss
    from gptoughts.training.objectives import build_objective

    loss_fn = make_loss(
        str(built.resolved["loss"]), compiled=bool(built.resolved["compile"]), chunk_size=perf.loss_chunk
    )
    objective = build_objective(family.objective, loss_fn)
    if built.pipeline is not None:  # the last stage computes the objective's loss from the final hidden state
        built.pipeline.hidden_loss = objective.hidden_loss
    return objective


def make_optimizer(
    model: nn.Module, t: TrainConfig, perf: PerfConfig, device: torch.device
) -> torch.optim.Optimizer:
    """``train.optimizer``: AdamW, or Muon for the hidden matrices + AdamW for the rest. A model with LoRA
    adapters keeps AdamW (:func:`optimizer_rule` says so in the plan). AdamW's moments are stored as
    ``train.optimizer_states`` says (:func:`~gptoughts.training.optim.with_states`)."""
    from gptoughts.training.optim import build_adamw, build_muon, with_states

    # On a GPU run, fused whatever the parameters' device: offloaded ones (FSDP2 CPUOffloadPolicy) step on the CPU
    # with torch's fused CPU kernel.
    fused = perf.fused_adamw is True or (perf.fused_adamw == "auto" and device.type == "cuda")
    common = dict(
        lr=t.learning_rate, weight_decay=t.weight_decay, betas=(t.beta1, t.beta2), eps=t.eps, fused=fused
    )
    if optimizer_rule(model, t)[0] == "muon":
        optimizer = build_muon(
            model,
            muon_lr=t.muon_learning_rate,
            muon_weight_decay=t.muon_weight_decay,
            momentum=t.muon_momentum,
            **common,
        )
    else:
        optimizer = build_adamw(model, **common)
    return with_states(optimizer, t.optimizer_states)


def optimizer_rule(model: nn.Module, t: TrainConfig) -> tuple[str, str]:
    """The optimizer this run uses, and why."""
    if t.optimizer == "muon":
        if any("lora_" in n for n, p in model.named_parameters() if p.requires_grad):
            return "adamw", "train.optimizer = muon, but LoRA adapters train with AdamW (low-rank factors)"
        return (
            "muon",
            "train.optimizer = muon: Muon for the hidden matrices, AdamW for embeddings, head, norms",
        )
    return "adamw", "train.optimizer = adamw"


def auto_micro_batch(
    built: Built,
    objective: Callable,
    *,
    vocab_size: int,
    block_size: int,
    precision: str,
    perf: PerfConfig,
    t: TrainConfig,
    device: torch.device,
    dist: pdist.DistInfo,
    parts: dict[str, object],
    cache_path: str | None = None,
) -> tuple[int, bool]:
    """The largest micro-batch that fits (see perf/autobatch.py), agreed on by all ranks (their minimum). The
    assembly asks on a GPU only (CPU runs are sized from memory estimates); on a CPU only a failed allocation
    counts, as the tests use it."""
    from gptoughts.perf.autobatch import BatchCache, find_batch_size
    from gptoughts.training.optim import set_lr, zero_grads

    model = (
        built.raw
    )  # no DDP: a rank that runs out of memory must not leave the others waiting in a collective
    # lr = 0 makes AdamW a no-op on the weights (decoupled decay is lr * wd) while allocating its real state.
    probe = make_optimizer(model, t, perf, device)  # with the run's optimizer states: their real size
    set_lr(probe, 0.0)  # torchao's 8-bit AdamW keeps lr as a tensor: set_lr updates it in place
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    params = [p for p in model.parameters() if p.requires_grad]

    def try_step(batch: int) -> None:
        x = torch.randint(0, vocab_size, (batch, block_size + 1), device=device)
        try:
            # As the run will: gradients kept between steps under CUDA graphs (their memory counts in the peak).
            zero_grads(probe, params, keep=built.keep_grads)
            for _ in range(2):  # the second step runs with the optimizer state allocated
                with contextlib.ExitStack() as stack:
                    if dtype is not None:
                        stack.enter_context(torch.autocast(device.type, dtype=dtype))
                    stack.enter_context(built.forward_context())
                    loss, _ = objective(model, (x[:, :-1], x[:, 1:]))
                loss.backward()
                probe.step()
                zero_grads(probe, params, keep=built.keep_grads)
        except BaseException:
            pdist.discard_failed_step(model)  # an offloaded (FSDP2) model out of memory is left mid-step
            raise
        finally:
            probe.zero_grad(set_to_none=True)

    try:
        with built.per_block():  # whole-model compile: the probe's batches must not each recompile the model
            best, cached = find_batch_size(
                try_step, device, parts=parts, cache=BatchCache(cache_path) if cache_path else None
            )
    finally:
        probe.state.clear()  # the real optimizer allocates its own state at the first real step
    if dist.enabled:
        agreed = torch.tensor(best, device=device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
        best = int(agreed.item())
    return best, cached


# --------------------------------------------------------------------------------------------------- LoRA
# Fine-tuning inserts one step after "load weights" in the order above: LoRA adapters (PEFT) on the loaded
# model, then the usual transforms (fp8 stays off: it would convert the frozen base layers).


def lora_base_dtype(lora: LoraConfig, precision: str) -> torch.dtype:
    """dtype of the frozen base weights. They need no fp32 master copy (never updated), so in bf16 training
    they are stored in bf16: half the weight memory, and no per-step cast of every weight by autocast."""
    if lora.base_dtype == "auto":
        return torch.bfloat16 if precision == "bf16" else torch.float32
    if lora.base_dtype != "fp32" and lora.base_dtype != precision:
        raise ConfigError(
            f"lora.base_dtype = {lora.base_dtype} needs --precision {lora.base_dtype} (the adapters "
            "compute in that dtype under autocast); or use lora.base_dtype = auto"
        )
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[lora.base_dtype]


def default_lora_targets(model: nn.Module) -> list[str]:
    """Full names of every linear layer inside the repeated blocks: all attention and MLP projections, never
    the LM head or embeddings (full names, so a same-named module outside the blocks cannot match)."""
    layers = model.layers
    prefix = next((n for n, m in model.named_modules() if m is layers), "layers")
    linear: tuple[type, ...] = (nn.Linear,)
    try:
        from transformers.pytorch_utils import Conv1D  # GPT-2 style "linear" layers of transformers models

        linear = (nn.Linear, Conv1D)
    except ImportError:
        pass
    return [f"{prefix}.{n}" for n, m in layers.named_modules() if isinstance(m, linear)]


def check_qlora(device: torch.device) -> None:
    if device.type != "cuda":
        raise HardwareError(
            "QLoRA (4-bit) needs a CUDA GPU and bitsandbytes; run LoRA without --lora.quantize or on a GPU"
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise HardwareError(
            "QLoRA (4-bit) needs bitsandbytes: pip install bitsandbytes (or drop --lora.quantize)"
        ) from None


def quantize_base_4bit(model: nn.Module, compute_dtype: torch.dtype) -> int:
    """Replace every linear layer of the blocks by a bitsandbytes NF4 ``Linear4bit`` (frozen); PEFT then puts
    its LoRA layers over them. Returns the number of layers quantized. (CUDA only; not exercised by the CPU
    test suite.)"""
    import bitsandbytes as bnb

    n = 0
    for module in list(model.layers.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            q = bnb.nn.Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                compute_dtype=compute_dtype,
                quant_type="nf4",
            )
            q.weight = bnb.nn.Params4bit(child.weight.data.to("cpu"), requires_grad=False, quant_type="nf4")
            if child.bias is not None:
                q.bias = nn.Parameter(child.bias.data.to("cpu"), requires_grad=False)
            setattr(module, name, q.to(child.weight.device))  # moving to CUDA is what quantizes
            n += 1
    return n


def apply_lora(
    model: nn.Module, lora: LoraConfig, *, device: torch.device, compute_dtype: torch.dtype = torch.bfloat16
) -> nn.Module:
    """Wrap ``model`` with PEFT LoRA adapters (base frozen). The result still obeys the model protocol: PEFT
    forwards attribute reads (``layers``, ``output_weight``, ``args``...) to the wrapped model."""
    import peft

    if lora.quantize == "4bit":
        check_qlora(device)
        quantize_base_4bit(model, compute_dtype)
    targets = list(lora.target_modules) or default_lora_targets(model)
    config = peft.LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets, bias="none"
    )
    if (
        lora.merged_forward and lora.quantize == "none"
    ):  # (a 4-bit layer is an nn.Linear too: PEFT's bnb layer)
        from gptoughts.perf.lora import MergedLoraLinear

        config._register_custom_module({nn.Linear: MergedLoraLinear})
    try:
        return peft.get_peft_model(model, config)
    except ValueError as e:
        if "target" not in str(e).lower():
            raise
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(
            f"lora.target_modules {lora.target_modules} match no layer; the linear layers are "
            f"named {', '.join(names)}"
        ) from None


class TrainableWeights(nn.Module):
    """The trainable parameters of a model under their own names, and nothing else: what a LoRA checkpoint
    holds (megabytes instead of the whole model; the frozen base is reloaded from ``model.init_from``).

    ``state_dict``/``load_state_dict`` read and write the model's own parameter tensors, so
    ``checkpoint.save``/``load_weights`` work on it unchanged. Trainer hooks of the model are passed through.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.__dict__["_params"] = {n: p for n, p in model.named_parameters() if p.requires_grad}
        for hook in ("after_optimizer_step", "log_metrics"):
            fn = getattr(model, hook, None)
            if fn is not None:
                self.__dict__[hook] = fn

    def state_dict(self, *args: object, **kwargs: object) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {n: p.detach() for n, p in self.__dict__["_params"].items()}

    def load_state_dict(
        self,
        state_dict: dict[str, torch.Tensor],
        strict: bool = True,  # type: ignore[override]
        assign: bool = False,
    ) -> nn.modules.module._IncompatibleKeys:
        params = self.__dict__["_params"]
        missing = [n for n in params if n not in state_dict]
        unexpected = [n for n in state_dict if n not in params]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"trainable weights mismatch: missing {missing[:4]}, unexpected {unexpected[:4]}"
            )
        with torch.no_grad():
            for n, p in params.items():
                if n in state_dict:
                    p.copy_(state_dict[n])
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.__dict__["_params"].values())
