"""Strict validation of a whole :class:`~gptoughts.config.schema.Config`: ranges of each section, fields that
conflict, and the ``[model]`` keys against the family they configure. Every failure is a
:class:`~gptoughts.errors.ConfigError` that names the key and the fix.
"""

from __future__ import annotations

import math
import typing

from gptoughts.coerce import coerce
from gptoughts.config.schema import (
    CheckpointConfig,
    Config,
    DpoConfig,
    EvalConfig,
    ModelConfig,
    ParallelConfig,
    PerfConfig,
    RecoveryConfig,
    TrainConfig,
)
from gptoughts.errors import ConfigError


def validate(cfg: Config) -> None:
    """Cross-field checks and the family-specific ``[model]`` keys (in this order: the first failure is the one
    reported)."""
    _validate_finetune(cfg)  # conflicts of the config itself, before a model is looked up (or downloaded)
    _validate_model(cfg.model)
    _check_batch(cfg.train)
    check_train_ranges(cfg.train, cfg.eval, cfg.checkpoint, cfg.recovery)
    if cfg.train.optimizer_states == "8bit" and cfg.train.optimizer == "muon":
        raise ConfigError(
            "train.optimizer_states = 8bit is AdamW's (torchao AdamW8bit); with train.optimizer = muon use "
            "--train.optimizer_states bf16"
        )
    check_parallel(cfg.parallel)
    _check_perf(cfg.perf)
    _check_fused_fp8(cfg)
    _check_profile(cfg.train.profile)
    _validate_eval_tasks(cfg)
    _validate_dpo(cfg)
    for p in cfg.data.phases:
        if p.weights and len(p.weights) != len(p.sources):
            raise ConfigError(
                f"data.phases `{p.name}`: {len(p.weights)} weights for {len(p.sources)} sources"
            )


def _validate_model(m: ModelConfig) -> None:
    """Check ``[model]`` against its family, and settle the family: a fine-tuned model's own (from its config), a
    variant's base family (``qwen2`` -> llama with its switch). Overrides given as text become the family's types."""
    from gptoughts import models

    if m.init_from is not None:
        # Fine-tuning: the model's config (a hub id's from the Hugging Face cache) says which family it is, and
        # `model.*` overrides are checked against that family (fields that change no parameter are allowed; the
        # load checks the shapes).
        from gptoughts.models.hf import find_adapter, locate, read_config
        from gptoughts.models.hf_export import run_config, run_of_model

        # a gptoughts run (finetune --model RUN): the config its export will write, before anything is exported
        where = locate(m.init_from, weights=False)
        config = run_config(where) if run_of_model(where) is not None else read_config(where)
        found = find_adapter(str(config["model_type"]))
        if found is None and m.overrides:
            raise ConfigError(
                f"model.{next(iter(m.overrides))}: {m.init_from} has no native "
                "implementation here (it trains through transformers), so its config cannot be "
                "overridden; drop the override"
            )
        if found is not None:
            m.family = found[0]
    # `--model qwen2` is the llama family with its switch: the run is built, saved and resumed as that
    m.family, m.overrides = models.resolve_variant(m.family, m.overrides)
    hints = typing.get_type_hints(models.get_family(m.family).args_cls)
    for key, value in m.overrides.items():  # "8" from the command line -> 8, as the family declares
        if isinstance(value, str) and key in hints:
            m.overrides[key] = coerce(value, hints[key], f"model.{key}")
    models.model_args(m.family, m.size, m.overrides)


def _check_batch(t: TrainConfig) -> None:
    if isinstance(t.batch_size, str) and t.batch_size != "auto":
        raise ConfigError(f"train.batch_size must be a positive integer or auto, got {t.batch_size!r}")
    for name in ("grad_accum", "block_size"):
        if getattr(t, name) < 1:
            raise ConfigError(f"train.{name} must be >= 1, got {getattr(t, name)}")
    if isinstance(t.batch_size, int) and t.batch_size < 1:
        raise ConfigError(f"train.batch_size must be >= 1, got {t.batch_size}")


def _check_perf(perf: PerfConfig) -> None:
    for name in ("compile", "cuda_graphs", "fp8", "fused_adamw", "muon_graph"):
        value = getattr(perf, name)
        if isinstance(value, str) and value != "auto":
            raise ConfigError(f"perf.{name} must be true, false or auto; got {value!r}")
    if perf.threads is not None and perf.threads < 1:
        raise ConfigError(
            f"perf.threads must be >= 1, got {perf.threads}; leave it out to measure the count (--threads N)"
        )
    if perf.gpu_memory_gib is not None and not perf.gpu_memory_gib > 0:
        raise ConfigError(f"perf.gpu_memory_gib must be > 0 GiB, got {perf.gpu_memory_gib}")
    if perf.fp8_bf16_end_layers < 0:
        raise ConfigError(f"perf.fp8_bf16_end_layers must be >= 0, got {perf.fp8_bf16_end_layers}")
    if perf.residual_dtype == "bf16" and perf.precision not in ("auto", "bf16"):
        raise ConfigError(
            f"perf.residual_dtype = bf16 needs bf16 mixed precision, but perf.precision is "
            f"{perf.precision}; use --precision bf16 or perf.residual_dtype = fp32"
        )


def _check_fused_fp8(cfg: Config) -> None:
    """What ``perf.fp8_recipe = fused_rowwise`` covers: the llama family's blocks, unsharded weights."""
    if cfg.perf.fp8_wgrad == "fp8" and cfg.perf.fp8_recipe != "fused_rowwise":
        raise ConfigError(
            f"perf.fp8_wgrad = fp8 is a setting of perf.fp8_recipe = fused_rowwise (the {cfg.perf.fp8_recipe} "
            "recipe sets its own weight gradients); add --perf.fp8_recipe fused_rowwise or drop perf.fp8_wgrad"
        )
    if cfg.perf.fp8_recipe != "fused_rowwise" or cfg.perf.fp8 is False:
        return
    use = "use perf.fp8_recipe = tensorwise or rowwise"
    if cfg.model.family != "llama":
        raise ConfigError(
            f"perf.fp8_recipe = fused_rowwise supports the llama family only, not {cfg.model.family}; {use}"
        )
    if cfg.parallel.tp > 1:
        raise ConfigError(f"perf.fp8_recipe = fused_rowwise does not combine with --parallel.tp yet; {use}")
    if cfg.perf.fp8_all_gather:
        raise ConfigError(
            "perf.fp8_all_gather needs perf.fp8_recipe = tensorwise (one scale per weight tensor)"
        )


def _check_profile(profile: str | None) -> None:
    if profile is None:
        return
    start, sep, end = profile.partition(":")
    if not (sep and start.isdigit() and end.isdigit() and int(start) < int(end)):
        raise ConfigError(
            f"train.profile must be START:END steps with START < END (e.g. 10:15); got {profile!r}"
        )


# The longest sequence any size here is built for is 8192; 1M positions already need GBs of RoPE tables. A
# larger block_size is a typo, refused before a model is built or a corpus read.
MAX_BLOCK_SIZE = 1 << 20


def check_train_ranges(
    t: TrainConfig,
    ev: EvalConfig | None = None,
    ck: CheckpointConfig | None = None,
    rc: RecoveryConfig | None = None,
) -> None:
    """The numeric ranges of ``[train]``, ``[eval]``, ``[checkpoint]`` and ``[recovery]`` (the trainer checks them
    again when it is built directly)."""
    ev, ck, rc = ev or EvalConfig(), ck or CheckpointConfig(), rc or RecoveryConfig()
    if not math.isfinite(t.learning_rate) or t.learning_rate <= 0:
        raise ConfigError(f"train.learning_rate must be a finite number > 0, got {t.learning_rate}")
    if t.block_size > MAX_BLOCK_SIZE:
        raise ConfigError(
            f"train.block_size = {t.block_size:,} is beyond what a model here can be built for "
            f"({MAX_BLOCK_SIZE:,} positions); use the sequence length you train at, e.g. 2048"
        )
    for name in ("max_steps", "epochs", "max_tokens"):
        value = getattr(t, name)
        if value is not None and (not math.isfinite(value) or value <= 0):
            raise ConfigError(f"train.{name} must be > 0 (got {value}): it would train nothing")
    sections = (("train", t), ("eval", ev), ("checkpoint", ck), ("recovery", rc))
    for sec, name in (("train", "log_interval"), ("eval", "eval_batches"), ("recovery", "max_bad_steps")):
        if getattr(dict(sections)[sec], name) < 1:
            raise ConfigError(f"{sec}.{name} must be >= 1, got {getattr(dict(sections)[sec], name)}")
    for sec, name in (
        ("eval", "eval_interval"),
        ("checkpoint", "save_interval"),
        ("eval", "sample_interval"),
        ("checkpoint", "keep_last"),
        ("train", "warmup_steps"),
        ("eval", "early_stopping_patience"),
        ("recovery", "max_rollbacks"),
        ("recovery", "spike_warmup_steps"),
        ("eval", "sample_max_new_tokens"),
        ("eval", "eval_tasks_interval"),
    ):
        value = getattr(dict(sections)[sec], name)
        if value is not None and value < 0:
            raise ConfigError(f"{sec}.{name} must be >= 0, got {value}")
    if t.global_batch_tokens is not None and t.global_batch_tokens < 1:
        raise ConfigError(f"train.global_batch_tokens must be >= 1, got {t.global_batch_tokens}")
    if ev.eval_tasks_limit is not None and ev.eval_tasks_limit < 1:
        raise ConfigError(
            f"eval.eval_tasks_limit must be >= 1 (None: all examples), got {ev.eval_tasks_limit}"
        )
    for where, ok, rule, value in (
        (
            "recovery.rollback_lr_factor",
            0.0 < rc.rollback_lr_factor <= 1.0,
            "in (0, 1]",
            rc.rollback_lr_factor,
        ),
        ("recovery.spike_std", rc.spike_std > 0, "> 0", rc.spike_std),
        ("recovery.spike_ratio", rc.spike_ratio >= 1.0, ">= 1", rc.spike_ratio),
        ("train.min_lr_ratio", 0.0 <= t.min_lr_ratio <= 1.0, "in [0, 1]", t.min_lr_ratio),
        ("train.decay_fraction", 0.0 <= t.decay_fraction <= 1.0, "in [0, 1]", t.decay_fraction),
        ("train.grad_clip", t.grad_clip >= 0 and math.isfinite(t.grad_clip), ">= 0", t.grad_clip),
        # (torch's AdamW refuses these only as the optimizer is built, with a traceback, after the run's folder is
        # written; a negative weight decay it takes, and grows every weight)
        ("train.weight_decay", 0.0 <= t.weight_decay < math.inf, ">= 0", t.weight_decay),
        ("train.beta1", 0.0 <= t.beta1 < 1.0, "in [0, 1)", t.beta1),
        ("train.beta2", 0.0 <= t.beta2 < 1.0, "in [0, 1)", t.beta2),
        ("train.eps", 0.0 <= t.eps < math.inf, ">= 0", t.eps),
        ("eval.sample_temperature", ev.sample_temperature >= 0, ">= 0 (0: greedy)", ev.sample_temperature),
        ("train.muon_momentum", 0.0 <= t.muon_momentum < 1.0, "in [0, 1)", t.muon_momentum),
        (
            "train.muon_learning_rate",
            t.muon_learning_rate is None
            or (math.isfinite(t.muon_learning_rate) and t.muon_learning_rate > 0),
            "a finite number > 0",
            t.muon_learning_rate,
        ),
        (
            "train.muon_weight_decay",
            t.muon_weight_decay is None or t.muon_weight_decay >= 0,
            ">= 0",
            t.muon_weight_decay,
        ),
    ):
        if not ok:
            raise ConfigError(f"{where} must be {rule}, got {value}")


def check_parallel(p: ParallelConfig) -> None:
    """The ranges of ``[parallel]`` (the world size is checked against them when the process group starts)."""
    for name in ("tp", "pp", "ep"):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(p, name)}")
    for name in ("reshard_after_forward", "grad_sync_every_microbatch"):
        value = getattr(p, name)
        if isinstance(value, str) and value != "auto":
            raise ConfigError(f"parallel.{name} must be true, false or auto; got {value!r}")
    if p.ddp_bucket_mb < 0:
        raise ConfigError(f"parallel.ddp_bucket_mb must be >= 0 (MB; 0: auto), got {p.ddp_bucket_mb}")
    if p.pp_microbatches < 0:
        raise ConfigError(f"parallel.pp_microbatches must be >= 0 (0: auto), got {p.pp_microbatches}")
    if p.pp_layers and (len(p.pp_layers) != p.pp * (2 if p.pp_schedule == "interleaved" else 1)):
        raise ConfigError(
            f"parallel.pp_layers has {len(p.pp_layers)} entries; it needs one per stage "
            f"({p.pp} with --parallel.pp {p.pp}{', x2 for interleaved' if p.pp_schedule == 'interleaved' else ''})"
        )
    if any(n < 1 for n in p.pp_layers):
        raise ConfigError(f"parallel.pp_layers entries must be >= 1, got {p.pp_layers}")
    if p.tp > 1 and p.pp > 1:
        raise ConfigError(
            "parallel.tp and parallel.pp do not combine yet: use one of them (with FSDP over the rest)"
        )
    if p.strategy == "none" and (p.tp > 1 or p.pp > 1):
        raise ConfigError(
            "parallel.strategy = none runs one process; tensor/pipeline parallelism needs torchrun"
        )
    _check_ep(p)


def _check_ep(p: ParallelConfig) -> None:
    """Expert parallelism runs under FSDP2, over the data-parallel ranks only."""
    if p.ep == 1:
        return
    where = f"--parallel.ep {p.ep}"
    if p.tp > 1 or p.pp > 1:
        raise ConfigError(
            f"{where} does not combine with --parallel.tp / --parallel.pp yet; use FSDP beside it"
        )
    if p.cpu_offload:
        raise ConfigError(f"{where} does not combine with --parallel.cpu_offload; drop one of them")
    if p.strategy in ("ddp", "none"):
        raise ConfigError(
            f"{where} runs under FSDP2 (the experts are DTensors); use --parallel.strategy fsdp (or auto)"
        )


def _validate_eval_tasks(cfg: Config) -> None:
    """What periodic task evaluation cannot run on yet (the files themselves are read when the run starts)."""

    if not cfg.eval.eval_tasks:
        return
    if cfg.parallel.pp > 1:
        raise ConfigError(
            "eval.eval_tasks does not run under pipeline parallelism (no rank holds the whole model); drop "
            "--eval_tasks and score the run afterwards with gptoughts eval RUN --tasks FILE.jsonl"
        )


def _validate_finetune(cfg: Config) -> None:
    lo = cfg.lora
    if lo.r < 1:
        raise ConfigError(f"lora.r must be >= 1, got {lo.r}")
    if lo.alpha <= 0:
        raise ConfigError(f"lora.alpha must be > 0, got {lo.alpha}")
    if not 0.0 <= lo.dropout < 1.0:
        raise ConfigError(f"lora.dropout must be in [0, 1), got {lo.dropout}")
    if lo.enabled and (cfg.parallel.strategy == "fsdp" or cfg.parallel.cpu_offload):
        raise ConfigError(
            "LoRA runs are data-parallel with DDP (parallel.strategy = auto or ddp): the frozen base "
            "is not sharded by this version's FSDP path"
        )
    if lo.quantize != "none" and not lo.enabled:
        raise ConfigError("lora.quantize needs LoRA: add --lora (QLoRA trains adapters over a 4-bit base)")
    if cfg.model.init_from is None and lo.enabled:
        raise ConfigError("LoRA adapts a pretrained model: pass --model HF_DIR (model.init_from) with --lora")


def _refuse_dpo_settings(cfg: Config) -> None:
    """A ``[dpo]`` value the user set on a run that is not preference tuning would be ignored: refused. (A value
    equal to its default is not refused: every run's config.toml lists the section, and it must resume.)"""
    default = DpoConfig()
    for name in DpoConfig.__dataclass_fields__:
        key = f"dpo.{name}"
        if cfg.is_given(key) and getattr(cfg.dpo, name) != getattr(default, name):
            raise ConfigError(
                f"{key} applies to preference tuning only: add --objective dpo (gptoughts finetune --model "
                f"HF_DIR --objective dpo --data PAIRS.jsonl) or drop --{key}"
            )


def _validate_dpo(cfg: Config) -> None:
    """``[dpo]`` ranges, and what preference tuning needs (a pretrained model, explicit batches, no pipeline)."""
    d = cfg.dpo
    if not d.beta > 0:
        raise ConfigError(f"dpo.beta must be > 0, got {d.beta}")
    if not 0.0 <= d.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing must be in [0, 0.5), got {d.label_smoothing}")
    if d.logp_chunk < 0:
        raise ConfigError(f"dpo.logp_chunk must be >= 0 (0: one pair), got {d.logp_chunk}")
    if d.logp_chunk_tokens < 0:
        raise ConfigError(
            f"dpo.logp_chunk_tokens must be >= 0 (0: logp_chunk rows' tokens), got {d.logp_chunk_tokens}"
        )
    if cfg.train.objective != "dpo":
        _refuse_dpo_settings(cfg)
        return
    if cfg.model.init_from is None:
        raise ConfigError(
            "--objective dpo tunes a pretrained model: use gptoughts finetune --model HF_DIR --objective dpo"
        )
    if d.reference == "adapters_off" and not cfg.lora.enabled:
        raise ConfigError("dpo.reference = adapters_off needs --lora; full fine-tuning uses precomputed")
    if cfg.parallel.pp > 1:
        raise ConfigError("--objective dpo does not run under pipeline parallelism yet; drop --parallel.pp")
    if cfg.train.batch_size == "auto":
        raise ConfigError(
            "--objective dpo needs --batch_size N (pairs per micro-batch); auto probes text batches"
        )
