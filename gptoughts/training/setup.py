"""Building the model that the trainer runs: the one place where transforms are applied, in one order.

Order (each step only if the :class:`~gptoughts.training.resolve.Transforms` decided it; nothing is decided
here): build on the meta device → materialise on the target device and initialise (or load) weights →
residual-stream dtype (an embedding hook) → fp8 conversion → pipeline split (this rank's stages; every later
step applies to each stage) → tensor parallel → activation checkpointing → compile (blocks) → FSDP / DDP →
[the batch is planned] → whole-model compile → optimizer. Model code stays single-device; everything here
wraps or converts it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gptoughts import models
from gptoughts.config import LoraConfig, ParallelConfig, PerfConfig, TrainConfig
from gptoughts.errors import ConfigError, HardwareError
from gptoughts.models import layers
from gptoughts.models.deepseek.moe import probe_experts
from gptoughts.parallel import dist as pdist
from gptoughts.parallel.ep import describe as describe_ep
from gptoughts.perf import checkpointing
from gptoughts.training.resolve import Transforms, input_embeddings, optimizer_rule


@dataclass
class Built:
    model: nn.Module
    """What the trainer calls (possibly compiled and/or DDP-wrapped)."""
    raw: nn.Module
    """The plain module (for state dicts, generation and export)."""
    spec: Transforms | None = None
    """What was applied (and, under whole-model compile, what :func:`apply_whole_model_compile` applies)."""
    forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    """Entered around every forward/backward (SDPA backend selection)."""
    fp8_linears: int | None = None
    """How many linears the fp8 conversion swapped (None: no fp8)."""
    parallel: str | None = None
    """The process layout, as the plan prints it (None: one process)."""
    after_optimizer_step: Callable[[], None] | None = None
    """Run by the trainer after each optimizer step (fp8 all-gather: the next step's weight scales)."""
    pipeline: Any = None
    """``parallel.pp.Pipeline`` under pipeline parallelism (``model`` is then its ``RankModel``), else None."""
    keep_grads: bool = False
    """CUDA graphs: gradients stay allocated between steps (zeroed, not freed), so that each backward adds into
    them in place. Freed, the first backward of a step would hand its graph's static output buffer over as
    ``.grad``, and the next micro-batch's replay would overwrite it ("accessing tensor output of CUDAGraphs that
    has been overwritten by a subsequent run" under gradient accumulation). A trainable parameter that gets no
    gradient in a step then has a zero one, and AdamW decays it (every parameter of our families gets a gradient
    in every step; checked at debug size)."""

    @property
    def resolved(self) -> dict[str, object]:
        """What each ``auto`` became (the spec's values, with what applying it counted), in the plan's order."""
        return settings(self.spec, self.parallel, self.fp8_linears)

    @property
    def why(self) -> dict[str, str]:
        """The rule that decided each entry of ``resolved`` ("asked", or the ``auto`` rule that applied)."""
        return dict(self.spec.why) if self.spec is not None else {}


def settings(
    spec: Transforms | None, parallel: str | None, fp8_linears: int | None = None
) -> dict[str, object]:
    """The spec's values with the process layout (:func:`parallel_layout`) and what applying the spec counted,
    in the plan's order: what a built model reports, and what a dry run reports of the model it does not build."""
    out: dict[str, object] = {}
    for key, value in (spec.resolved() if spec is not None else {}).items():
        if key == "fp8" and fp8_linears is not None:
            out["fp8_linears"] = fp8_linears
        if key == "loss" and parallel is not None:
            out["parallel"] = parallel
        out[key] = value
    return out


def parallel_layout(dist: pdist.DistInfo, raw: nn.Module) -> str | None:
    """The process layout as the plan prints it (None: one process, nothing sharded). Read from what is decided
    before the model is built (the process group's shape, the model's expert count: the meta model's equals the
    real one's), so a dry run prints the line its run will."""
    if not (dist.enabled or dist.sharded):
        return None
    return describe_parallel(dist, getattr(raw.args, "n_routed_experts", 0))


def build_raw_model(family: str, args: object, device: torch.device, seed: int) -> nn.Module:
    """Meta-device build, then allocate on ``device`` and initialise from ``seed`` (no wasted CPU init)."""
    with torch.device("meta"):
        model = models.build_model(family, args)
    model.to_empty(device=device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        model.init_weights()
    return model


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
    embeddings = input_embeddings(model)
    for m in embeddings:
        m.register_forward_hook(_residual_to_bf16)
    return len(embeddings)


def _forward_context(
    perf: PerfConfig, kernels: layers.AttentionKernels | None = None
) -> Callable[[], contextlib.AbstractContextManager]:
    sdpa = sdpa_context(perf.sdpa_backend)
    kernels = kernels or layers.AttentionKernels()
    if not perf.cuda_graphs and kernels == layers.AttentionKernels():
        return sdpa

    @contextlib.contextmanager
    def ctx():
        if perf.cuda_graphs:
            # Each forward starts a new CUDA-graph "iteration": the previous one's outputs were consumed by its
            # backward (or are eval outputs), so their static buffers may be reused.
            torch.compiler.cudagraph_mark_step_begin()
        with sdpa(), layers.use_attention_kernels(kernels):
            yield

    return ctx


def attention_kernels(chosen: dict[str, str], device: torch.device) -> layers.AttentionKernels:
    """The kernels ``layers.sdpa`` routes to, as ``resolve.attention_rule`` chose them."""
    from gptoughts.perf import attention

    return layers.AttentionKernels(
        fa4=attention.FA4() if chosen["sdpa_backend"] == "fa4" else None,
        doc=attention.FlexDocAttention(compiled=device.type == "cuda")
        if chosen["doc_mask_attention"] == "flex"
        else None,
    )


def apply_transforms(
    raw: nn.Module,
    spec: Transforms,
    *,
    device: torch.device,
    dist: pdist.DistInfo,
    precision: str = "fp32",
    parallel: ParallelConfig | None = None,
    family: str = "",
) -> Built:
    """The transforms ``spec`` decided, in their one order (the module docstring); the whole model's compile
    comes later, once the batch is planned (:func:`apply_whole_model_compile`)."""
    # The experts learn where their inputs will be before any (checkpointed) forward: under CPU offload it is not
    # where their weights are.
    probe_experts(raw, device)
    if spec.embeddings_hooked:
        set_residual_dtype(raw, spec.residual_dtype)
    fp8_linears = apply_fp8(raw, spec, device)
    par = parallel or ParallelConfig()
    parts, stage_ids, n_stages = split_pipeline(raw, dist, par)
    if dist.tp > 1:  # build_model ran check_tp before (tensor and pipeline parallelism do not combine)
        from gptoughts.parallel.tp import apply_tp

        apply_tp(raw, dist.mesh["tp"], family)
    if dist.ep > 1:  # build_model ran check_ep before (not with tensor or pipeline parallelism)
        from gptoughts.parallel.ep import apply_ep

        apply_ep(raw, dist.ep_mesh)
    for part in parts:  # inside the compiled region
        checkpointing.apply_activation_checkpointing(part, spec.activation_checkpointing)
    apply_compile(parts, spec, whole_later=whole_model_later(spec, dist))
    parts = [
        pdist.wrap(part, device, dist, precision) for part in parts
    ]  # DDP, or FSDP2 over compiled blocks
    pipeline = None
    if dist.pp > 1:
        pipeline = make_pipeline(raw, parts, stage_ids, n_stages, spec, dist, device, precision, par)
    return Built(
        model=pipeline.view if pipeline is not None else parts[0],
        raw=raw,
        spec=spec,
        forward_context=_forward_context(spec.perf, attention_kernels(spec.resolved(), device)),
        fp8_linears=fp8_linears,
        parallel=parallel_layout(dist, raw),
        after_optimizer_step=_fp8_scales(parts) if spec.fp8_all_gather else None,
        pipeline=pipeline,
        keep_grads=spec.compiled and spec.cuda_graphs,
    )


def describe_parallel(dist: pdist.DistInfo, n_experts: int = 0) -> str:
    dp = (
        f"{dist.strategy} x{dist.dp_size}"
        if dist.strategy == "fsdp" or dist.tp == 1
        else f"dp x{dist.dp_size}"
    )
    return (
        dp
        + (f", tp x{dist.tp}" if dist.tp > 1 else "")
        + (f", pipeline x{dist.pp}" if dist.pp > 1 else "")
        + (f", {describe_ep(dist.ep, n_experts)}" if dist.ep > 1 else "")
        + (" + cpu offload" if dist.cpu_offload else "")
    )


def apply_fp8(raw: nn.Module, spec: Transforms, device: torch.device) -> int | None:
    """fp8 linears (before compile, so the compiled graph holds the casts and fuses them); how many, or None."""
    if not spec.fp8:
        return None
    from gptoughts.perf.fp8 import check_fp8_supported, convert_to_fp8

    check_fp8_supported(device)
    p = spec.perf
    if p.fp8_recipe == "fused_rowwise":
        from gptoughts.perf.fp8_fused import convert_to_fused_fp8

        return convert_to_fused_fp8(raw, p.fp8_bf16_end_layers, p.fp8_fast_accum, p.fp8_wgrad == "fp8")
    return convert_to_fp8(raw, p.fp8_recipe, p.fp8_bf16_end_layers, spec.fp8_all_gather, p.fp8_fast_accum)


def _fp8_scales(parts: list[nn.Module]) -> Callable[[], None]:
    """After each optimizer step under fp8 all-gather: the next step's weight scales, for each stage."""
    from gptoughts.perf.fp8 import precompute_scales

    def after() -> None:
        for part in parts:  # a pipeline's stages (raw's other tensors are on the meta device there)
            precompute_scales(part)

    return after


def split_pipeline(
    raw: nn.Module, dist: pdist.DistInfo, par: ParallelConfig
) -> tuple[list[nn.Module], list[int], int]:
    """This rank's pipeline stages (after fp8, which swaps modules in place: the stages share them), their ids
    and the number of stages; ``[raw]`` without pipeline parallelism. Later transforms apply to each stage."""
    if dist.pp == 1:
        return [raw], [0], 1
    from gptoughts.parallel import pp

    n_stages = pp.stages_of(dist.pp, par.pp_schedule)
    split = pp.split_layers(len(raw.layers), n_stages, par.pp_layers)
    stage_ids = [s for s in range(n_stages) if s % dist.pp == dist.pp_rank]
    parts = [pp.make_stage(raw, split[s], first=s == 0, last=s == n_stages - 1) for s in stage_ids]
    return parts, stage_ids, n_stages


def whole_model_later(spec: Transforms, dist: pdist.DistInfo) -> bool:
    """Whole-model compile in a replicated run: the blocks are compiled now (evaluations and the auto-batch probe
    run their graphs), the whole model once the batch is planned, for training at the run's batch shape (each
    probe's batch would recompile it: +94 s to the first step at 125m)."""
    return spec.compiled and spec.compile_mode == "model" and dist.pp == 1 and not dist.sharded


def apply_compile(parts: list[nn.Module], spec: Transforms, *, whole_later: bool) -> None:
    """Module.compile() compiles in place, so parameter names (and checkpoints) are unchanged. Per-block compile
    keeps compile time flat in depth; the blocks are identical, so one graph is reused."""
    if not spec.compiled:
        return
    for part in parts:
        if spec.compile_mode == "blocks" or whole_later:
            _graphs_per_block_kind(part.layers)
            for block in part.layers:
                block.compile(mode=spec.block_mode)
        else:  # sharded or pipelined: the whole stage, before FSDP wraps it
            part.compile(mode=spec.inductor_mode)


def _graphs_per_block_kind(blocks: nn.Module) -> None:
    """Every block shares one ``forward``, and dynamo keeps at most ``recompile_limit`` graphs of a function before
    running it eagerly: training and evaluation (grad mode), the auto-batch probe's static then dynamic shapes, per
    kind of block (by class and parameter shapes: DeepSeek's dense and MoE blocks are two). So 8 per kind."""
    kinds = {(type(b), tuple(p.shape for p in b.parameters())) for b in blocks}
    limit = 8 * len(kinds)
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name, limit) < limit:
        setattr(config, name, limit)


def apply_whole_model_compile(built: Built) -> None:
    """Training runs the whole model as one graph (blocks inlined); evaluations keep the per-block graphs."""
    built.model = WholeModel(built.model, torch.compile(built.model, mode=built.spec.inductor_mode))


class WholeModel(nn.Module):
    """A forward with gradients (training) runs the whole model's compiled graph; one without (evaluations) runs
    ``module``, whose blocks are compiled: a whole-model inference graph per evaluation shape would otherwise be
    compiled (and, under CUDA graphs, recorded)."""

    def __init__(self, module: nn.Module, compiled: Callable[..., Any]):
        super().__init__()
        self.module = module
        self._whole = (compiled,)  # in a tuple: not a submodule (its parameters are module's)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            return self._whole[0](*args, **kwargs)
        return self.module(*args, **kwargs)


def make_pipeline(
    raw: nn.Module,
    parts: list[nn.Module],
    stage_ids: list[int],
    n_stages: int,
    spec: Transforms,
    dist: pdist.DistInfo,
    device: torch.device,
    precision: str,
    par: ParallelConfig,
) -> Any:
    from gptoughts.parallel import pp

    bf16_stream = spec.embeddings_hooked and spec.residual_dtype == "bf16" and precision == "bf16"
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
    _drop_other_stages(raw, parts)
    return pipeline


def _drop_other_stages(raw: nn.Module, parts: list[nn.Module]) -> None:
    """The whole model was built on every rank (the weights of a one-process run); what this rank's stages do not
    hold (or, under FSDP, hold as shards of their own) is dead weight: it goes to the meta device, keeping shapes
    and names (parameter counts, the plan, the optimizer's order of parameters)."""
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
    model: nn.Module, t: TrainConfig, perf: PerfConfig, device: torch.device, *, graph: bool = False
) -> torch.optim.Optimizer:
    """``train.optimizer``: AdamW, or Muon for the hidden matrices + AdamW for the rest. A model with LoRA
    adapters keeps AdamW (:func:`optimizer_rule` says so in the plan). AdamW's moments are stored as
    ``train.optimizer_states`` says (:func:`~gptoughts.training.optim.with_states`); ``graph``: Muon's step
    replayed as one CUDA graph (:func:`~gptoughts.training.optim.muon_graph_rule`)."""
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
            compile=perf.muon_compile,
            distribute=perf.muon_distribute,
            graph=graph,
            **common,
        )
    else:
        optimizer = build_adamw(model, **common)
    return with_states(optimizer, t.optimizer_states)


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
    accumulates: bool = False,
    reserve_bytes: int = 0,
    capacity: int | None = None,
) -> tuple[int, bool]:
    """The largest micro-batch that fits (see perf/autobatch.py), agreed on by all ranks (their minimum). The
    assembly asks on a GPU only (CPU runs are sized from memory estimates); on a CPU only a failed allocation
    counts, as the tests use it. ``accumulates``: the run will accumulate gradients, so every micro-batch after the
    first runs beside the whole gradient; the probe's second step does too. ``reserve_bytes``: memory the run will
    hold that the probe's steps do not (Muon's recorded step), allocated aside while probing. ``capacity``: the
    bytes the run may fill (a --gpu_memory_gib cap; None: the whole GPU), which the probe's margin is taken of."""
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
            # The second step runs with the optimizer state allocated and, under accumulation, the gradients.
            for _ in range(2):
                with contextlib.ExitStack() as stack:
                    if dtype is not None:
                        stack.enter_context(torch.autocast(device.type, dtype=dtype))
                    stack.enter_context(built.forward_context())
                    loss, _ = objective(model, (x[:, :-1], x[:, 1:]))
                loss.backward()
                probe.step()
                zero_grads(probe, params, keep=built.keep_grads or accumulates)
        except BaseException:
            pdist.discard_failed_step(model)  # an offloaded (FSDP2) model out of memory is left mid-step
            raise
        finally:
            probe.zero_grad(set_to_none=True)

    aside = torch.empty(reserve_bytes, dtype=torch.uint8, device=device) if reserve_bytes else None
    try:  # (before any whole-model compile: the probe's batches run the per-block graphs)
        best, cached = find_batch_size(
            try_step,
            device,
            parts=parts,
            cache=BatchCache(cache_path) if cache_path else None,
            capacity=capacity,
        )
    finally:
        probe.state.clear()  # the real optimizer allocates its own state at the first real step
        del aside
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
    return [f"{prefix}.{n}" for n, m in layers.named_modules() if isinstance(m, _linear_types())]


def _linear_types() -> tuple[type, ...]:
    """The layers PEFT puts adapters on: ``nn.Linear``, and transformers' GPT-2 style ``Conv1D``."""
    try:
        from transformers.pytorch_utils import Conv1D

        return (nn.Linear, Conv1D)
    except ImportError:
        return (nn.Linear,)


def check_qlora(device: torch.device) -> None:
    if device.type != "cuda":
        raise HardwareError(
            "QLoRA (4-bit) needs a CUDA GPU and bitsandbytes; run LoRA without --qlora (--lora.quantize) or on a GPU"
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
    if lora.target_modules:
        _check_lora_targets(model, list(lora.target_modules))
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


def _check_lora_targets(model: nn.Module, targets: list[str]) -> None:
    """Refuse target names that match no linear layer. PEFT refuses only a list of which none matches: with one
    name right and one wrong (``wq,v_proj``), the wrong one's layers were left without adapters, silently. Hugging
    Face's names of a native model's layers (``q_proj`` for ``wq``) are named in the fix."""
    from gptoughts.models.llama_hf import hf_linear_names

    names = [n for n, m in model.named_modules() if isinstance(m, _linear_types())]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if not missing:
        return
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
    ours = {hf: leaf for hf, leaf in hf_linear_names().items() if leaf in leaves}
    fix = ""
    if all(t in ours for t in missing):
        fixed = ",".join(ours.get(t, t) for t in targets)
        fix = f" (Hugging Face's names; this model's are ours: --target_modules {fixed})"
    raise ConfigError(
        f"lora.target_modules {', '.join(missing)} match no linear layer of this model{fix}; its linear layers "
        f"are named {', '.join(leaves)}"
    )


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
