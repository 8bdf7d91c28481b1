"""The model step of the assembly: build on the meta device, load (fine-tuning) or initialise, LoRA, then the
transforms that ``training/resolve.py`` decided, applied by ``training/setup.py``."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptoughts import models
from gptoughts.config import Config
from gptoughts.errors import ConfigError, DataError
from gptoughts.training.corpus import Data
from gptoughts.training.environment import Environment


@dataclass
class Model:
    family: models.Family
    args: Any
    raw: nn.Module
    """The plain module: state dicts, generation, export."""
    weights: nn.Module
    """What checkpoints hold: the whole model, or for LoRA only the adapters (TrainableWeights)."""
    built: Any = None
    """setup.Built: the transformed model the trainer runs (None in a dry run)."""
    objective: Any = None
    pretrained: Any = None
    """models.hf.Pretrained when fine-tuning."""
    transforms: Any = None
    """resolve.Transforms: how the model is (or, in a dry run, would be) transformed, every ``auto`` decided."""


def build_model(cfg: Config, env: Environment, data: Data, *, meta: bool = False) -> Model:
    """Build on meta, then load (fine-tuning) or initialise, LoRA, then the transforms in their one order.
    ``meta``: stop after building on the meta device (dry run: parameter counts without memory)."""
    from gptoughts.training.resolve import resolve_transforms
    from gptoughts.training.setup import TrainableWeights, apply_transforms, make_objective

    # Offloaded runs keep the weights in CPU memory: build or load them there (the model may not fit the GPU).
    home = torch.device("meta") if meta else torch.device("cpu") if env.dist.cpu_offload else env.device
    if data.init_from is not None:
        pretrained, raw, perf = _pretrained(cfg, env, data, home)
        family, args = models.family_of(pretrained.family), pretrained.model.args
    else:
        pretrained, perf = None, cfg.perf
        family, args, raw = _from_scratch(cfg, env, data, home)
    if env.dist.pp > 1:  # refused in one line before anything is written
        from gptoughts.parallel import pp

        generic = bool(pretrained is not None and pretrained.generic)
        pp.check_supported(
            family.name, args, lora=cfg.lora.enabled, generic=generic, objective=family.objective
        )
    spec = resolve_transforms(
        raw,
        perf=perf,
        hw=env.hw,
        device=env.device,
        dist=env.dist,
        precision=env.precision,
        family=family.name,
        lora=cfg.lora,
        auto_batch=cfg.train.batch_size == "auto",
    )
    weights = TrainableWeights(raw) if cfg.lora.enabled else raw
    out = Model(family=family, args=args, raw=raw, weights=weights, pretrained=pretrained, transforms=spec)
    if meta:
        return out
    out.built = apply_transforms(
        raw, spec, device=env.device, dist=env.dist, precision=env.precision, parallel=cfg.parallel,
        family=family.name,
    )  # fmt: skip
    if cfg.train.objective == "dpo":
        from gptoughts.training.dpo import build_dpo

        out.objective = build_dpo(
            cfg.dpo, lora=cfg.lora.enabled, compiled=bool(out.built.resolved["compile"])
        )
    else:
        out.objective = make_objective(family, out.built, cfg.perf)
    return out


def apply_planned_compile(env: Environment, model: Model) -> None:
    """The whole model's compile, once the batch is planned (and the CPU thread probe has run its steps): train's
    assembly and every timing run (``components.timing_trainer``) call it, so that both run the graph the plan
    reports."""
    from gptoughts.training.setup import WholeModel, apply_whole_model_compile, whole_model_later

    if (
        model.built is not None
        and whole_model_later(model.built.spec, env.dist)
        and not isinstance(model.built.model, WholeModel)  # once: a second call would nest the wrapper
    ):
        apply_whole_model_compile(model.built)


def _pretrained(cfg: Config, env: Environment, data: Data, home: torch.device) -> tuple[Any, nn.Module, Any]:
    """The model fine-tuning starts from, checked against the run: (pretrained, model, perf)."""
    if cfg.lora.enabled and cfg.lora.quantize == "4bit":
        from gptoughts.training.setup import check_qlora

        check_qlora(env.device)  # refused where the plan is made (a dry run too), as the run would refuse it
    pretrained, raw, perf = build_finetune_model(cfg, data.init_from, home, env.precision)
    _check_tp(cfg, env, pretrained.family, pretrained.model.args, generic=pretrained.generic)
    if pretrained.generic and env.dist.sharded:
        raise ConfigError(
            f"parallel.strategy = fsdp covers the native families; {data.init_from} runs on the "
            "generic transformers path (tied weights, generate): use DDP (the default)"
        )
    args = pretrained.model.args
    if args.vocab_size < data.vocab_size:
        raise DataError(
            f"the tokenizer of {data.init_from} has {data.vocab_size} tokens but the model only "
            f"{args.vocab_size} embeddings; fix the model folder"
        )
    if args.max_seq_len < cfg.train.block_size:
        raise ConfigError(
            f"--block_size {cfg.train.block_size} exceeds the {args.max_seq_len} positions of "
            f"{cfg.model.init_from}; pass --block_size {args.max_seq_len} or less (or leave it out)"
        )
    return pretrained, raw, perf


def _from_scratch(
    cfg: Config, env: Environment, data: Data, home: torch.device
) -> tuple[Any, Any, nn.Module]:
    """(family, args, model) of a new model of ``model.family``/``model.size`` for this vocabulary, initialised
    from ``train.seed`` on ``home`` (not allocated on the meta device)."""
    from gptoughts.training.setup import build_raw_model

    family = models.get_family(cfg.model.family)
    overrides = dict(cfg.model.overrides)
    overrides.setdefault("vocab_size", round_up(data.vocab_size, 64))
    if family.objective == "diffusion":
        mask_id = data.tokenizer.mask_id if data.tokenizer is not None else 2
        if mask_id is None:
            raise ConfigError(
                "LLaDA needs a mask token; use --tokenizer bpe:N or bytes (which reserve <|mask|>)"
            )
        overrides.setdefault("mask_token_id", mask_id)
    args = models.model_args(family.name, cfg.model.size, overrides)
    if getattr(args, "vocab_size", data.vocab_size) < data.vocab_size:
        raise ConfigError(
            f"model.vocab_size = {args.vocab_size} is smaller than the tokenizer's "
            f"{data.vocab_size}; drop the override or raise it"
        )
    if hasattr(args, "max_seq_len") and args.max_seq_len < cfg.train.block_size:
        args = replace(args, max_seq_len=cfg.train.block_size)
    if getattr(args, "integrator_impl", None) == "triton":
        from gptoughts.models import inl_triton

        if not inl_triton.will_run(args.controller_hidden, env.device, env.precision):
            args = replace(args, integrator_impl="fused")  # what runs here, and what the estimate then counts
    _check_tp(cfg, env, family.name, args)
    if home.type == "meta":
        with torch.device("meta"):
            return family, args, models.build_model(family.name, args, device="meta")
    return family, args, build_raw_model(family.name, args, home, cfg.train.seed)


def _check_tp(cfg: Config, env: Environment, family: str, args: object, *, generic: bool = False) -> None:
    """Tensor and expert parallelism's one-line refusals (parallel/tp.py, parallel/ep.py), before any weight is
    loaded or file written."""
    from gptoughts.parallel.tp import check_tp

    check_tp(family, args, env.dist.tp, generic=generic, lora=cfg.lora.enabled)
    from gptoughts.parallel.ep import check_ep

    check_ep(family, args, env.dist.ep, generic=generic, lora=cfg.lora.enabled)


def round_up(n: int, multiple: int) -> int:
    return ((n + multiple - 1) // multiple) * multiple


def build_finetune_model(
    cfg: Config, init_from: Path, device: torch.device, precision: str
) -> tuple[Any, nn.Module, Any]:
    """The model a fine-tuning run trains: ``init_from`` loaded (native or generic), LoRA applied when enabled.

    Returns ``(pretrained, model, perf)``; ``perf`` is ``cfg.perf`` with fp8 off under LoRA (fp8 would convert
    the frozen base layers). The frozen base is loaded directly in ``lora.base_dtype`` (no fp32 copy is ever
    allocated). ``model.*`` overrides that leave the architecture unchanged (e.g. DeepSeek's
    ``bias_update_rate``) apply to native families."""
    from gptoughts.models.hf import load_pretrained
    from gptoughts.training.setup import apply_lora, lora_base_dtype

    base_dtype = lora_base_dtype(cfg.lora, precision) if cfg.lora.enabled else torch.float32
    pretrained = load_pretrained(
        init_from,
        device=device,
        trust_remote_code=cfg.model.trust_remote_code,
        dtype=base_dtype,
        overrides=cfg.model.overrides,
    )
    model, perf = pretrained.model, cfg.perf
    if cfg.lora.enabled:
        if perf.fp8 is True:
            raise ConfigError(
                "--fp8 converts the frozen base layers; it does not combine with --lora (drop one)"
            )
        perf = replace(perf, fp8=False)
        if device.type == "meta":
            # The plan's model (a dry run's too): the adapters on meta, so that it counts the trainable parameters
            # and refuses target modules that match no layer as the run does (4-bit needs no device here: the
            # adapters over a quantized base have the same shapes).
            with torch.device("meta"):
                model = apply_lora(model, replace(cfg.lora, quantize="none"), device=device)
            return pretrained, model, perf
        # The adapters' random init is a function of train.seed alone (not of what ran before in the process).
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(cfg.train.seed)
            model = apply_lora(
                model,
                cfg.lora,
                device=device,
                compute_dtype=torch.float16 if precision == "fp16" else torch.bfloat16,
            )
    return pretrained, model, perf
