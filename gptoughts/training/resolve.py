"""Decide first: every ``auto`` of a run, resolved with its reason before anything is built.

:func:`resolve_transforms` turns the config, the hardware, the process group and a few facts of the model (read
from its meta-device build: width, parameter count, frozen weights) into one frozen :class:`Transforms`, which
``training/setup.py`` applies step by step without deciding anything; :func:`resolve_run` adds the batch plan,
the pipeline's micro-batches and the optimizer into one frozen :class:`RunSpec`, whose ``resolved`` entries the
plan prints and ``run.json`` records. Each ``*_rule`` returns ``(value, why)``: "asked", or the ``auto`` rule
that applied.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from gptoughts.config import Config, LoraConfig, PerfConfig, TrainConfig
from gptoughts.errors import ConfigError, HardwareError, UserError
from gptoughts.parallel import dist as pdist
from gptoughts.perf import ce, checkpointing, hardware
from gptoughts.perf.hardware import HardwareProfile
from gptoughts.training.plan import BatchPlan


def reshard_rule(
    cfg: Config, info: pdist.DistInfo, hw: HardwareProfile, device: torch.device, precision: str = "bf16"
) -> tuple[bool, str]:
    """``parallel.reshard_after_forward`` resolved, and why. auto keeps every block gathered from its forward to
    its backward (no second all-gather: 1b scaled 97.1% instead of 95.4% on 2 x H200, bench/BENCHMARKS.md) when
    the memory estimate with them kept stays under 80% of the GPU at the asked micro-batch; it frees them when
    the estimate does not fit, or cannot be made (an HF model, batch_size auto, a CPU)."""
    asked = cfg.parallel.reshard_after_forward
    if asked is not True and asked is not False:
        asked = "auto"
    if asked != "auto":
        return bool(asked), "asked"
    t = cfg.train
    mem = (hw.memory_bytes or 0) / 2**30
    if device.type != "cuda" or not mem or not isinstance(t.batch_size, int) or cfg.model.init_from:
        return True, "auto: no estimate to check the kept weights against"
    if precision not in ("bf16", "fp16"):  # fp32 training gathers fp32 weights: kept, they would cost twice
        return True, f"auto: {precision} weights are resharded (kept gathered only in bf16/fp16)"
    from gptoughts.perf.estimate import estimate

    try:
        e = estimate(
            cfg.model.family,
            cfg.model.size,
            cfg.model.overrides,
            batch_size=t.batch_size,
            block_size=t.block_size,
            activation_checkpointing=checkpointing.resolve(cfg.perf.activation_checkpointing, cfg.lora)[0],
            num_gpus=info.world_size,
            strategy="fsdp",
            optimizer=t.optimizer,
            optimizer_states=t.optimizer_states,
            tp=info.tp,
            reshard_after_forward=False,
            accum_unsharded_grads=t.grad_accum > 1 and not info.sync_every_microbatch,
            residual_dtype="bf16" if precision == "bf16" and cfg.perf.residual_dtype != "fp32" else "fp32",
        )
    except Exception:  # noqa: BLE001 - an estimate must never stop a run
        return True, "auto: no estimate to check the kept weights against"
    if e.total_gib <= 0.8 * mem:
        return (
            False,
            f"auto: blocks kept gathered until backward (~{e.total_gib:.0f} GiB of {mem:.0f} estimated)",
        )
    return True, f"auto: blocks resharded after forward (kept, ~{e.total_gib:.0f} GiB > 80% of {mem:.0f})"


def grad_sync_rule(cfg: Config, info: pdist.DistInfo, hw: HardwareProfile) -> tuple[bool, str]:
    """``parallel.grad_sync_every_microbatch`` resolved, and why (schema: the rule). Between the micro-batches of
    a step FSDP2 otherwise keeps each parameter's unsharded gradient in fp32 (its reduce dtype): the whole
    model's, less what tensor and pipeline parallelism take off this rank."""
    asked = cfg.parallel.grad_sync_every_microbatch
    if info.pp > 1:
        # torch's pipeline stages turn FSDP2's gradient sync off for every micro-batch but the last themselves
        # (PipelineStage.backward_maybe_with_nosync): no setting of ours reaches in between.
        unheld = "; asked true, which the schedule does not allow" if asked is True else ""
        return False, f"pipeline: its schedule reduces after the last micro-batch{unheld}"
    if asked is True or asked is False:
        return asked, "asked"
    if info.cpu_offload:
        return True, "auto: under CPU offload the gradients leave the GPU after each micro-batch"
    mem = (hw.memory_bytes or 0) / 2**30
    if not mem or cfg.model.init_from:
        return False, "auto: no size to check the unsharded gradient against"
    from gptoughts.perf.estimate import unsharded_grad_bytes

    try:
        gib = (
            unsharded_grad_bytes(
                cfg.model.family, cfg.model.size, cfg.model.overrides, info.tp, info.pp, info.ep
            )
            / 2**30
        )
    except Exception:  # noqa: BLE001 - an estimate must never stop a run
        return False, "auto: no size to check the unsharded gradient against"
    if gib <= 0.1 * mem:
        return False, f"auto: the unsharded fp32 gradient, ~{gib:.1f} GiB, is within 10% of {mem:.0f} GiB"
    return True, f"auto: the unsharded fp32 gradient, ~{gib:.0f} GiB, would pass 10% of {mem:.0f} GiB"


def resolve_grad_sync(cfg: Config, info: pdist.DistInfo, hw: HardwareProfile) -> tuple[pdist.DistInfo, str]:
    """``info`` with :func:`grad_sync_rule` applied, and the plan's words for it (an FSDP2 run's: the environment's,
    and the one the memory layout search moves to CPU offload)."""
    sync, reason = grad_sync_rule(cfg, info, hw)
    words = ("every micro-batch" if sync else "after the last micro-batch") + f" ({reason})"
    return replace(info, sync_every_microbatch=sync), words


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
    lora: LoraConfig | None = None,
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
    if (lora is not None and lora.enabled) or any(not p.requires_grad for p in raw.parameters()):
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
        return hardware.fp8_auto(hw.arch, d_model, perf.fp8_recipe)
    return bool(perf.fp8), "asked"


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


def attention_rule(perf: PerfConfig, device: torch.device) -> tuple[dict[str, str], dict[str, str]]:
    """What ``sdpa_backend`` and ``doc_mask_attention`` become, and why (``setup.attention_kernels`` builds the
    kernels they name).

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
    doc, doc_why = perf.doc_mask_attention, "asked"
    if doc == "auto":
        doc, doc_why = (
            "sdpa",
            "auto: dense mask (flex is faster but failed in a GPU run; --perf.doc_mask_attention flex)",
        )
    return (
        {"sdpa_backend": backend, "doc_mask_attention": doc},
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


def residual_rule(perf: PerfConfig, hw: HardwareProfile) -> tuple[str, str]:
    if perf.residual_dtype != "auto":
        return perf.residual_dtype, "asked"
    residual = str(hw.recommended.get("residual_dtype", "fp32"))
    return residual, f"auto: {residual} on {hw.arch} (bf16 where the GPU has it; acts under bf16 only)"


def input_embeddings(model: nn.Module) -> list[nn.Embedding]:
    """The embeddings outside the blocks: where the residual stream starts."""
    inside = {id(m) for m in model.layers.modules()}
    return [m for m in model.modules() if isinstance(m, nn.Embedding) and id(m) not in inside]


@dataclass(frozen=True)
class Transforms:
    """How the model is transformed, every ``auto`` resolved (``why``: the reason of each entry)."""

    residual_dtype: str
    embeddings_hooked: bool
    fp8: bool
    fp8_all_gather: bool
    activation_checkpointing: str
    compiled: bool
    compile_mode: str
    """blocks or model: the whole model is compiled after the batch is planned (``setup.apply_whole_model_compile``)"""
    whole_model_auto: bool
    """``compile_mode = auto`` chose the whole model: the assembly keeps it only for a run long enough to repay it."""
    cuda_graphs: bool
    inductor_mode: str | None
    block_mode: str | None
    """torch.compile's mode for the blocks (without CUDA graphs under whole-model compile: the whole model's replay)"""
    loss: str
    sdpa_backend: str
    doc_mask_attention: str
    perf: PerfConfig
    """``perf`` with compile_mode and cuda_graphs resolved (the kernels' and the loss's settings)"""
    why: dict[str, str] = field(default_factory=dict)

    def resolved(self) -> dict[str, object]:
        """What each ``auto`` became, in the order the plan prints it (values only; ``why`` says why)."""
        out: dict[str, object] = {}
        if self.embeddings_hooked:
            out["residual_dtype"] = self.residual_dtype
        if self.fp8:
            out["fp8"] = self.perf.fp8_recipe
            if self.perf.fp8_fast_accum:
                out["fp8_fast_accum"] = True
            if self.perf.fp8_wgrad == "fp8":
                out["fp8_wgrad"] = "fp8"
            if self.perf.fp8_all_gather:
                out["fp8_all_gather"] = self.fp8_all_gather
        else:
            out["fp8"] = False
        out["activation_checkpointing"] = self.activation_checkpointing
        out["compile"] = self.compile_mode if self.compiled else False
        if self.compiled and self.cuda_graphs:
            out["cuda_graphs"] = True
        if self.compiled and self.inductor_mode:
            out["inductor_mode"] = self.inductor_mode
        out["loss"] = self.loss
        out["sdpa_backend"] = self.sdpa_backend
        out["doc_mask_attention"] = self.doc_mask_attention
        return out

    def with_blocks(self, why: str) -> Transforms:
        """The whole model's compile given up for the per-block graphs (``why``: the rule that decided)."""
        reasons = {**self.why, "compile": self.why.get("compile", "").split("; ")[0] + f"; blocks: {why}"}
        return replace(self, compile_mode="blocks", whole_model_auto=False, why=reasons)


def resolve_transforms(
    raw: nn.Module,
    *,
    perf: PerfConfig,
    hw: HardwareProfile,
    device: torch.device,
    dist: pdist.DistInfo,
    precision: str = "fp32",
    family: str = "",
    lora: LoraConfig | None = None,
    auto_batch: bool = False,
) -> Transforms:
    """Every transform's ``auto`` for ``raw`` (its meta-device build will do: only its shape is read)."""
    why: dict[str, str] = {}
    residual, why["residual_dtype"] = residual_rule(perf, hw)
    fp8, why["fp8"] = fp8_rule(perf, hw, raw)
    gather = fp8 and perf.fp8_all_gather and dist.strategy == "fsdp"
    if fp8 and perf.fp8_all_gather:
        why["fp8_all_gather"] = "asked" if gather else "asked, but only FSDP all-gathers weights: off"
    ac, why["activation_checkpointing"] = checkpointing.resolve(perf.activation_checkpointing, lora)
    compiled, why["compile"] = compile_rule(perf, hw)
    mode, mode_why = compile_mode_rule(perf, compiled, raw, family, dist, device, lora)
    if compiled:
        why["compile"] += f"; {mode}: {mode_why}"
    graphs, graphs_why = cuda_graphs_rule(perf, compiled, family, lora, dist, device, precision, auto_batch)
    if compiled and graphs and graphs_why != "asked":
        why["cuda_graphs"] = graphs_why
    if not compiled and (perf.cuda_graphs is True or perf.max_autotune):
        raise ConfigError(
            "perf.cuda_graphs and perf.max_autotune are torch.compile modes: add --compile true "
            "(or drop them)"
        )
    perf = replace(perf, compile_mode=mode, cuda_graphs=graphs)
    whole = compiled and mode == "model" and dist.pp == 1 and not dist.sharded
    inductor = inductor_mode(perf)
    why["loss"] = (
        "asked" if perf.loss != "auto" else "auto: chunked on CUDA (no fp32 logits of the whole batch)"
    )
    chosen, reasons = attention_rule(perf, device)
    why.update(reasons)
    return Transforms(
        residual_dtype=residual,
        embeddings_hooked=residual != "fp32" and bool(input_embeddings(raw)),
        fp8=fp8,
        fp8_all_gather=gather,
        activation_checkpointing=ac,
        compiled=compiled,
        compile_mode=mode if compiled else "blocks",
        # asked CUDA graphs replay the whole-model graph (the blocks' are compiled without): kept at any length
        whole_model_auto=whole and mode_why.startswith("auto") and not graphs,
        cuda_graphs=graphs,
        inductor_mode=inductor,
        block_mode=inductor if mode == "blocks" else inductor_mode(replace(perf, cuda_graphs=False)),
        loss=ce.loss_rule(perf.loss, device),
        sdpa_backend=chosen["sdpa_backend"],
        doc_mask_attention=chosen["doc_mask_attention"],
        perf=perf,
        why=why,
    )


@dataclass(frozen=True)
class RunSpec:
    """What the run decided before it starts: the typed values the builders read, and ``resolved``: each setting
    as "value (why)", which the plan prints and ``run.json`` records."""

    transforms: Transforms | None
    batch: BatchPlan
    pipeline_micro: int | None
    """Micro-batches of one pipeline step (None without pipeline parallelism)."""
    optimizer: str | None
    resolved: dict[str, str]


def resolve_run(
    cfg: Config,
    env_resolved: dict[str, str],
    transforms: Transforms | None,
    applied: dict[str, object] | None,
    batch: BatchPlan,
    dist: pdist.DistInfo,
    raw: nn.Module | None,
    threads: str | None = None,
    device_type: str | None = None,
) -> RunSpec:
    """The run's :class:`RunSpec`. ``applied``: what the build applied (``Built.resolved``: the spec's values and
    what applying them counted), None in a dry run (the spec's own values); ``threads``: the CPU thread count and
    why, when known before the plan."""
    values = applied if applied is not None else transforms.resolved() if transforms is not None else {}
    why = transforms.why if transforms is not None else {}
    built = {k: f"{v} ({why[k]})" if k in why else str(v) for k, v in values.items()}
    # (the config's own last: the memory layout's reasons replace the "asked" of the values it set)
    resolved = {**env_resolved, **built, **batch.why, **cfg.resolved}
    micro = None
    if dist.pp > 1 and raw is not None:
        from gptoughts.parallel import pp

        par = cfg.parallel
        micro = pp.microbatches(
            batch.micro_batch * batch.grad_accum, dist.pp, par.pp_schedule, par.pp_microbatches
        )
        split = pp.split_layers(raw.args.n_layers, pp.stages_of(dist.pp, par.pp_schedule), par.pp_layers)
        resolved["pipeline"] = pp.describe(split, dist.pp, par.pp_schedule, micro)
    optimizer = None
    if raw is not None:
        graphs = transforms is not None and transforms.compiled and transforms.cuda_graphs
        optimizer, resolved["optimizer"] = optimizer_line(cfg, raw, dist, device_type, graphs)
    if threads is not None:
        resolved["threads"] = threads
    return RunSpec(transforms, batch, micro, optimizer, _defaults_not_asked(cfg, resolved))


def _defaults_not_asked(cfg: Config, resolved: dict[str, str]) -> dict[str, str]:
    """A rule's "asked" means "not auto"; where the user did not set the value, the plan says whose default it is
    instead: the framework's, or the family and size's training defaults (or fine-tuning's) where they change it."""
    from dataclasses import fields

    from gptoughts.config.schema import SECTIONS

    whose = (
        f"the {cfg.model.family}/{cfg.model.size} default"
        if cfg.model.init_from is None
        else "the fine-tuning default"
    )
    out = dict(resolved)
    for key, text in resolved.items():
        if not isinstance(text, str) or not text.endswith(" (asked)"):
            continue
        sections = [s for s, kind in SECTIONS.items() if key in {f.name for f in fields(kind)}]
        if not sections or any(cfg.is_given(f"{s}.{key}") for s in sections):
            continue
        s = sections[0]
        framework = getattr(getattr(cfg, s), key) == getattr(SECTIONS[s](), key)
        out[key] = f"{text[: -len(' (asked)')]} ({'default' if framework else whose})"
    return out


def optimizer_line(
    cfg: Config,
    raw: nn.Module,
    dist: pdist.DistInfo | None = None,
    device_type: str | None = None,
    model_graphs: bool = False,
) -> tuple[str, str]:
    """The optimizer and its plan line: states, peak learning rate, schedule, and why (and, for Muon, how
    its Newton-Schulz step runs where a perf switch asked for another way)."""
    from gptoughts.training.optim import describe_states

    name, why = optimizer_rule(raw, cfg.train)
    t = cfg.train
    lr = f"peak lr {t.learning_rate:.1e}" + (
        f" (Muon {t.muon_learning_rate:.1e})" if name == "muon" and t.muon_learning_rate else ""
    )
    if "learning_rate" in cfg.resolved:
        lr += f" ({cfg.resolved['learning_rate']})"
    states = describe_states(t.optimizer_states) + (" for the AdamW groups" if name == "muon" else "")
    line = f"{name} ({states}), {lr}, {t.schedule} schedule ({why})"
    if name != "muon":
        return name, line
    from gptoughts.training.optim import muon_graph_rule

    dist = dist or pdist.DistInfo()
    step = muon_step_words(cfg.perf, dist, device_type)
    line += f"; Newton-Schulz {step}" if step else ""
    if muon_graph_rule(cfg.perf, model_graphs, dist, device_type, t.optimizer_states):
        line += "; the optimizer step replayed as one CUDA graph (perf.muon_graph)"
    return name, line


def muon_step_words(perf: PerfConfig, dist: pdist.DistInfo, device_type: str | None) -> str:
    """What ``perf.muon_compile`` / ``muon_distribute`` do in this run (as ``training/optim.py`` decides it), or
    "" when neither is asked: compiled where the matrices are on CUDA (not offloaded ones); spread only over
    matrices sharded on 2+ ranks."""
    words = []
    if perf.muon_compile:
        if device_type == "cuda" and not dist.cpu_offload:
            words.append("compiled per shape group")
        else:
            words.append("eager (perf.muon_compile compiles on CUDA only, not offloaded matrices)")
    if perf.muon_distribute:
        sharded = dist.world_size > 1 and (dist.strategy == "fsdp" or dist.tp > 1)
        words.append(
            f"spread over the {dist.world_size} ranks"
            if sharded
            else "whole on every rank (perf.muon_distribute: no sharded matrices)"
        )
    return ", ".join(words)
