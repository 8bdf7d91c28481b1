"""The typed configuration tree, TOML presets and dotted overrides.

A run is described by one :class:`Config`: sections ``model``, ``data``, ``train``, ``perf``, ``parallel``,
``run`` and ``lora``. Each section is a dataclass whose fields are documented where they are declared.
Configs are data: TOML files (``gptoughts/presets/*.toml`` or a user's file) and ``--section.key value``
overrides, never Python code. Validation is strict: an unknown key or a wrong type raises
:class:`~gptoughts.errors.ConfigError` naming the closest valid key.

The ``[model]`` table is special: besides ``family``, ``size`` and ``init_from`` it accepts any field of the
chosen family's architecture dataclass (e.g. ``n_layers``), validated by :func:`gptoughts.models.model_args`.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from gptoughts.errors import ConfigError, did_you_mean

PRESET_DIR = Path(__file__).parent / "presets"
DEFAULT_PRESET = "quickstart"


@dataclass
class ModelConfig:
    family: str = "llama"
    """Model family: llama, … (see ``gptoughts.models.FAMILIES``)."""
    size: str = "debug"
    """Size preset of the family (``debug`` always exists and runs on CPU in seconds)."""
    init_from: str | None = None
    """A local Hugging Face model folder to start from instead of random init (``gptoughts finetune --model``):
    its config, weights and tokenizer are used; llama/mistral/qwen2/qwen3 run natively, others through
    transformers."""
    trust_remote_code: bool = False
    """Let transformers run the model folder's own Python code (models it does not ship); off unless asked."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Family architecture fields that override the size preset (any other key of ``[model]`` lands here)."""


@dataclass
class PhaseConfig:
    name: str = "phase"
    """Label shown in logs and metrics."""
    sources: list[str] = field(default_factory=list)
    """Paths (as given in ``data.sources``) drawn from in this phase."""
    weights: list[float] = field(default_factory=list)
    """Sampling weight per source; empty means proportional to each source's token count."""
    tokens: int | None = None
    """Token budget of the phase (global, all ranks); None: until training stops. Phases run in order."""


@dataclass
class DataConfig:
    sources: list[str] = field(default_factory=list)
    """Corpus: text files, folders (recursive), .jsonl, .parquet, saved HF datasets. ``@stdlib`` is the
    running interpreter's standard library source (the embedded default)."""
    tokenizer: str = "bpe:8192"
    """``bpe:VOCAB`` (trained on the corpus), ``bytes``, or a local HF tokenizer folder."""
    text_field: str = "text"
    """Field holding the text in .jsonl/.parquet/HF datasets."""
    extensions: list[str] = field(default_factory=list)
    """File extensions read in folders; empty means the built-in list (txt, md, py, json, ...)."""
    val_fraction: float = 0.005
    """Fraction of documents held out for validation."""
    max_bytes: int | None = None
    """Read at most this many bytes of text (keeps the quickstart fast); None reads everything."""
    cache_dir: str | None = None
    """Where token shards are cached; default ``$GPTOUGHTS_CACHE`` or ``~/.cache/gptoughts``."""
    phases: list[PhaseConfig] = field(default_factory=list)
    """Curriculum: ordered phases, each with its sources, weights and token budget."""
    format: str = "auto"
    """text (token shards, next-token loss on everything), sft (JSONL of {"prompt","response"} or
    {"messages":[...]}: loss on response tokens only) or auto (sft for .jsonl sources whose first record has
    those keys, else text)."""
    packing: bool = True
    """SFT: pack several examples per row (no attention across them, positions restart per example); false
    puts one example per row, padded."""
    truncation: str = "right"
    """SFT examples longer than a row: right (keep the first block_size+1 tokens) or drop (skip the example).
    Both are counted and reported."""


@dataclass
class TrainConfig:
    max_steps: int | None = None
    """Optimizer steps to run. If none of max_steps/epochs/max_tokens is set, one epoch is run."""
    epochs: float | None = None
    """Passes over the training tokens (fractions allowed)."""
    max_tokens: int | None = None
    """Token budget (global, all ranks)."""
    batch_size: int | str = 8
    """Micro-batch per device in sequences, or ``auto`` (largest that fits)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    global_batch_tokens: int | None = None
    """With ``batch_size = auto``: grad_accum is set so that one step sees about this many tokens."""
    block_size: int = 256
    """Sequence length in tokens."""
    learning_rate: float = 3e-4
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine and wsd)."""
    schedule: str = "cosine"
    """cosine (warmup then cosine decay), wsd (warmup-stable-decay) or constant (after warmup)."""
    warmup_steps: int | None = None
    """Linear warmup steps; None means 2% of the run (at least 1, at most 2000)."""
    decay_fraction: float = 0.2
    """wsd only: fraction of the run spent decaying at the end."""
    weight_decay: float = 0.1
    """AdamW weight decay; never applied to norms, biases and embeddings."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables."""
    seed: int = 1337
    eval_interval: int = 200
    """Evaluate every N steps (and at the end); 0 disables periodic evaluation."""
    eval_batches: int = 20
    """Micro-batches of validation data per evaluation."""
    log_interval: int = 10
    """Read losses from the device and log every N steps (the only host-device sync of the loop)."""
    save_interval: int = 500
    """Checkpoint every N steps (and at the end); 0 saves only at the end."""
    keep_last: int = 3
    """Checkpoints kept besides the best one."""
    checkpoints: bool = True
    """Write checkpoints at all (false only for throwaway runs such as benchmarks: nothing can be resumed)."""
    sample_interval: int | None = None
    """Generate samples every N steps; None means at each evaluation; 0 disables."""
    sample_prompts: list[str] = field(default_factory=lambda: ["def fibonacci(n):"])
    sample_max_new_tokens: int = 64
    sample_temperature: float = 0.8
    sample_top_k: int | None = 50
    early_stopping_patience: int | None = None
    """Stop after this many evaluations without val-loss improvement; None disables."""
    early_stopping_min_delta: float = 0.0
    nan_policy: str = "skip"
    """On a non-finite loss or gradient: skip (drop the step), rollback (reload the last checkpoint and halve
    the learning rate after repeated failures) or raise."""
    max_bad_steps: int = 20
    """Consecutive non-finite steps tolerated before a rollback (or an error if no checkpoint exists)."""
    profile: str | None = None
    """``START:END``: record a torch.profiler trace of steps START..END into ``RUN/profile/`` (Perfetto or
    TensorBoard open it)."""


@dataclass
class PerfConfig:
    device: str = "auto"
    """auto, cpu, cuda, cuda:N or mps."""
    precision: str = "auto"
    """auto (bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPU), fp32, bf16 or fp16."""
    compile: bool | str = "auto"
    """torch.compile the model: true, false or auto (on for CUDA GPUs, off on CPU)."""
    compile_mode: str = "blocks"
    """blocks (compile each transformer block: one graph reused, fast to compile) or model (whole model)."""
    cuda_graphs: bool = False
    """Replay the compiled graphs as CUDA graphs (torch.compile mode reduce-overhead): no kernel-launch gaps,
    more memory. Off by default: it only pays where the GPU waits on launches (bench/BENCHMARKS.md)."""
    max_autotune: bool = False
    """Inductor benchmarks Triton matmul templates against cuBLAS and fuses epilogues (compile takes minutes)."""
    residual_dtype: str = "auto"
    """dtype of the residual stream (the activations between blocks) under bf16 mixed precision: fp32, bf16
    (the embedding output is cast to bf16, so every block reads and writes bf16 activations and gradients, as
    with bf16 parameters in torchtitan/FSDP and Megatron's default; norms still compute in fp32), or auto (bf16
    on GPUs with bf16: +6% tokens/s at 125m, +1% at 1b, less memory; fp32 elsewhere). Only acts under bf16."""
    fp8: bool | str = False
    """FP8 matmuls through torchao float8 (Ada/Hopper+): true, false or auto (on for Hopper+ at d_model >= 2048)."""
    fp8_recipe: str = "tensorwise"
    """tensorwise (one scale per tensor, fastest) or rowwise (one scale per row, more robust)."""
    fp8_bf16_end_layers: int = 0
    """With fp8: keep the first and the last this-many transformer blocks in bf16 (closer loss, less speed)."""
    activation_checkpointing: str = "none"
    """none, selective (recompute cheap ops, keep matmul outputs) or full (recompute whole blocks)."""
    sdpa_backend: str = "auto"
    """Attention kernel: auto (PyTorch picks), flash, cudnn, efficient or math."""
    loss: str = "auto"
    """LM-head cross-entropy: auto, plain, chunked (no full fp32 logits) or liger (Liger-Kernel, if installed)."""
    loss_chunk: int = 4096
    """Rows per chunk for the chunked loss."""
    tf32: bool = True
    """Allow TF32 matmuls for any fp32 work left on Ampere+ GPUs."""
    fused_adamw: bool | str = "auto"
    """Use the fused CUDA AdamW (auto: on CUDA)."""
    expandable_segments: bool = True
    """CUDA allocator with expandable segments: less fragmentation when batch shapes vary (eval vs train)."""


@dataclass
class ParallelConfig:
    strategy: str = "auto"
    """auto (ddp when launched by torchrun with several processes), ddp, fsdp (FSDP2: parameters, gradients and
    optimizer state sharded across the ranks; for models whose training state does not fit one GPU), or none."""
    backend: str = "auto"
    """Process-group backend: auto (nccl on CUDA, gloo on CPU), nccl or gloo."""


@dataclass
class RunConfig:
    out: str = "runs/quickstart"
    """Run directory: config.toml, metrics.jsonl, tensorboard/, samples.txt, checkpoints/."""
    overwrite: bool = False
    """Replace a run dir that holds a different run."""
    resume: str | None = None
    """auto (newest valid checkpoint of ``out``) or a checkpoint path."""
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "gptoughts"
    progress: bool = True
    """Show a rich progress bar (rank 0, on a terminal)."""


@dataclass
class LoraConfig:
    enabled: bool = False
    """Train low-rank adapters (PEFT LoRA) instead of every weight; needs ``model.init_from``."""
    r: int = 16
    """Rank of the adapters."""
    alpha: float = 32.0
    """Scale: the update is ``alpha / r * B @ A``."""
    dropout: float = 0.0
    """Dropout on the adapters' input (0, PEFT's default, allows the merged forward below; 0.05-0.1 is common
    for small data sets and takes PEFT's standard, slower path)."""
    target_modules: list[str] = field(default_factory=list)
    """Module names to adapt (suffixes, e.g. ``wq,wv`` natively or ``q_proj,v_proj`` on transformers models);
    empty means every linear layer of the transformer blocks (attention and MLP projections)."""
    quantize: str = "none"
    """none, or 4bit (QLoRA: NF4 base weights through bitsandbytes; CUDA only)."""
    base_dtype: str = "auto"
    """dtype of the frozen base weights: auto (bf16 when training in bf16, else fp32), fp32, bf16 or fp16.
    A frozen weight needs no fp32 master copy, gradient or optimizer state: bf16 halves its memory."""
    merged_forward: bool = True
    """Fold each adapter into its frozen weight (``W + alpha/r * B @ A``) for the step instead of running it
    beside the base matmul: same result, one matmul per layer (gptoughts/perf/lora.py). Applies when the
    adapter input has no dropout (or in eval), the base is not 4-bit and the call has enough tokens to pay for
    the fold (training batches, not decoding); false keeps PEFT's own forward."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        overrides = d["model"].pop("overrides")
        d["model"].update(overrides)
        return d


# --------------------------------------------------------------------------------------------- validation

_MODEL_FIXED = {f.name for f in dataclasses.fields(ModelConfig)} - {"overrides"}


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against annotation ``tp``, converting CLI strings ("3", "true", "a,b") when asked to."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args:
            return None
        members = [a for a in args if a is not type(None)]
        if len(members) == 1:  # `X | None`: X's own message is the clearer one
            return _coerce(value, members[0], where)
        # Try non-str members first so "8" becomes 8 for `int | str`.
        for arg in sorted(members, key=lambda a: a is str):
            try:
                return _coerce(value, arg, where)
            except ConfigError:
                pass
        raise ConfigError(f"{where} must be {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"{where} must be one of {typing.get_args(tp)}, got {value!r}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v != ""] if value else []
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table, got {value!r}")
        return _build(tp, value, where)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            text = value.strip().replace("_", "")
            try:
                return int(text)
            except ValueError:
                try:  # "1e6" is a fine way to write a token budget
                    as_float = float(text)
                except ValueError:
                    as_float = None
                if as_float is not None and as_float.is_integer():
                    return int(as_float)
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where} must be a string, got {value!r}")
    raise TypeError(f"unsupported config annotation {tp!r} at {where}")


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in data.items():
        if key not in names or (cls is ModelConfig and key == "overrides"):
            if cls is ModelConfig:
                extra[key] = value
                continue
            raise ConfigError(f"unknown config key `{where}.{key}`{did_you_mean(key, names)}".replace("`.", "`"))
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}".lstrip("."))
    obj = cls(**kwargs)
    if cls is ModelConfig:
        obj.overrides.update(extra)
    return obj


def from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a Config from nested dicts (the parsed TOML)."""
    return _build(Config, data, "")


def _deep_update(base: dict[str, Any], upd: dict[str, Any]) -> dict[str, Any]:
    for k, v in upd.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _deep_update(base[k], v)
        else:
            base[k] = v
    return base


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def read_toml(name_or_path: str | Path) -> dict[str, Any]:
    """Read a preset by name or a TOML file by path, following ``base = "other-preset"`` chains."""
    path = Path(name_or_path)
    if not path.suffix == ".toml" or not path.exists():
        candidate = PRESET_DIR / f"{name_or_path}.toml"
        if candidate.exists():
            path = candidate
        elif str(name_or_path).endswith(".toml"):
            raise ConfigError(f"config file {name_or_path} does not exist; pass a preset name or an existing .toml")
        else:
            raise ConfigError(f"unknown preset `{name_or_path}`{did_you_mean(str(name_or_path), list_presets())}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None
    base = data.pop("base", None)
    if base is not None:
        data = _deep_update(read_toml(base), data)
    return data


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Apply ``a.b.c = value`` to nested dicts (validation happens later, in :func:`from_dict`)."""
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"`{key}`: `{p}` is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def load_config(preset: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Preset (name or TOML path; default ``quickstart``) + dotted overrides -> validated Config."""
    data = read_toml(preset if preset is not None else DEFAULT_PRESET)
    top = [f.name for f in dataclasses.fields(Config)]
    overrides = overrides or {}
    preset_model = data.get("model", {})
    new_family = overrides.get("model.family")
    if new_family is not None and new_family != preset_model.get("family", ModelConfig.family):
        # The preset's architecture fields describe its own family (quickstart's d_model, n_kv_heads, ...):
        # another family starts from its size presets, not from them.
        data["model"] = {k: v for k, v in preset_model.items() if k in _MODEL_FIXED and k != "size"}
    for key, value in overrides.items():
        section = key.split(".")[0]
        if section not in top:
            raise ConfigError(f"unknown config key `{key}`: sections are {', '.join(top)}{did_you_mean(section, top)}")
        set_dotted(data, key, value)
    cfg = from_dict(data)
    validate(cfg)
    return cfg


def _coerce_model_overrides(cfg: Config) -> None:
    """`--model.n_layers 8` arrives as the string "8": give it the type the family's args dataclass declares."""
    from gptoughts import models

    fam = models.get_family(cfg.model.family)
    hints = typing.get_type_hints(fam.args_cls)
    for key, value in list(cfg.model.overrides.items()):
        if isinstance(value, str) and key in hints and hints[key] is not str:
            cfg.model.overrides[key] = _coerce(value, hints[key], f"model.{key}")


def validate(cfg: Config) -> None:
    """Cross-field checks and the family-specific ``[model]`` keys."""
    from gptoughts import models

    _coerce_model_overrides(cfg)
    models.model_args(cfg.model.family, cfg.model.size, cfg.model.overrides)
    t = cfg.train
    if isinstance(t.batch_size, str) and t.batch_size != "auto":
        raise ConfigError(f"train.batch_size must be a positive integer or auto, got {t.batch_size!r}")
    for name in ("grad_accum", "block_size"):
        if getattr(t, name) < 1:
            raise ConfigError(f"train.{name} must be >= 1, got {getattr(t, name)}")
    if isinstance(t.batch_size, int) and t.batch_size < 1:
        raise ConfigError(f"train.batch_size must be >= 1, got {t.batch_size}")
    choices = {
        "train.schedule": (t.schedule, ("cosine", "wsd", "constant")),
        "train.nan_policy": (t.nan_policy, ("skip", "rollback", "raise")),
        "perf.precision": (cfg.perf.precision, ("auto", "fp32", "bf16", "fp16")),
        "parallel.strategy": (cfg.parallel.strategy, ("auto", "ddp", "fsdp", "none")),
        "parallel.backend": (cfg.parallel.backend, ("auto", "nccl", "gloo")),
    }
    for where, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(f"{where} must be one of {', '.join(allowed)}; got {value!r}{did_you_mean(value, allowed)}")
    for name in ("compile", "fp8", "fused_adamw"):
        value = getattr(cfg.perf, name)
        if isinstance(value, str) and value != "auto":
            raise ConfigError(f"perf.{name} must be true, false or auto; got {value!r}")
    perf_choices = {
        "perf.compile_mode": (cfg.perf.compile_mode, ("blocks", "model")),
        "perf.fp8_recipe": (cfg.perf.fp8_recipe, ("tensorwise", "rowwise")),
        "perf.activation_checkpointing": (cfg.perf.activation_checkpointing, ("none", "selective", "full")),
        "perf.sdpa_backend": (cfg.perf.sdpa_backend, ("auto", "flash", "cudnn", "efficient", "math")),
        "perf.loss": (cfg.perf.loss, ("auto", "plain", "chunked", "liger")),
        "perf.residual_dtype": (cfg.perf.residual_dtype, ("auto", "fp32", "bf16")),
    }
    for where, (value, allowed) in perf_choices.items():
        if value not in allowed:
            raise ConfigError(f"{where} must be one of {', '.join(allowed)}; got {value!r}{did_you_mean(value, allowed)}")
    if cfg.perf.fp8_bf16_end_layers < 0:
        raise ConfigError(f"perf.fp8_bf16_end_layers must be >= 0, got {cfg.perf.fp8_bf16_end_layers}")
    if cfg.perf.residual_dtype == "bf16" and cfg.perf.precision not in ("auto", "bf16"):
        raise ConfigError(f"perf.residual_dtype = bf16 needs bf16 mixed precision, but perf.precision is "
                          f"{cfg.perf.precision}; use --precision bf16 or perf.residual_dtype = fp32")
    if t.profile is not None:
        start, sep, end = t.profile.partition(":")
        if not (sep and start.isdigit() and end.isdigit() and int(start) < int(end)):
            raise ConfigError(f"train.profile must be START:END steps with START < END (e.g. 10:15); got {t.profile!r}")
    if t.learning_rate <= 0:
        raise ConfigError(f"train.learning_rate must be > 0, got {t.learning_rate}")
    for p in cfg.data.phases:
        if p.weights and len(p.weights) != len(p.sources):
            raise ConfigError(f"data.phases `{p.name}`: {len(p.weights)} weights for {len(p.sources)} sources")
    _validate_finetune(cfg)


def _validate_finetune(cfg: Config) -> None:
    d, lo = cfg.data, cfg.lora
    choices = {
        "data.format": (d.format, ("auto", "text", "sft")),
        "data.truncation": (d.truncation, ("right", "drop")),
        "lora.quantize": (lo.quantize, ("none", "4bit")),
        "lora.base_dtype": (lo.base_dtype, ("auto", "fp32", "bf16", "fp16")),
    }
    for where, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(f"{where} must be one of {', '.join(allowed)}; got {value!r}{did_you_mean(value, allowed)}")
    if lo.r < 1:
        raise ConfigError(f"lora.r must be >= 1, got {lo.r}")
    if lo.alpha <= 0:
        raise ConfigError(f"lora.alpha must be > 0, got {lo.alpha}")
    if not 0.0 <= lo.dropout < 1.0:
        raise ConfigError(f"lora.dropout must be in [0, 1), got {lo.dropout}")
    if lo.enabled and cfg.parallel.strategy == "fsdp":
        raise ConfigError("LoRA runs are data-parallel with DDP (parallel.strategy = auto or ddp): the frozen base "
                          "is not sharded by this version's FSDP path")
    if lo.quantize != "none" and not lo.enabled:
        raise ConfigError("lora.quantize needs LoRA: add --lora (QLoRA trains adapters over a 4-bit base)")
    if cfg.model.init_from is not None:
        if cfg.model.overrides:
            key = next(iter(cfg.model.overrides))
            raise ConfigError(f"model.{key} cannot be changed when fine-tuning: the architecture comes from "
                              f"{cfg.model.init_from}; drop the override")
    elif lo.enabled:
        raise ConfigError("LoRA adapts a pretrained model: pass --model HF_DIR (model.init_from) with --lora")


# ----------------------------------------------------------------------------------------------- TOML out

def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items() if x is not None) + "}"
    raise TypeError(f"cannot write {v!r} to TOML")


def to_toml(cfg: Config) -> str:
    """The fully resolved config as TOML (None values are omitted: they are the defaults)."""
    out: list[str] = ["# Fully resolved gptoughts config (written by the run; edit a copy to start a new one)."]
    for section, values in cfg.to_dict().items():
        out.append(f"\n[{section}]")
        tables = []
        for k, v in values.items():
            if v is None:
                continue
            if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
                tables.append((k, v))
                continue
            out.append(f"{k} = {_toml_value(v)}")
        for k, rows in tables:
            for row in rows:
                out.append(f"\n[[{section}.{k}]]")
                out.extend(f"{rk} = {_toml_value(rv)}" for rk, rv in row.items() if rv is not None)
    return "\n".join(out) + "\n"


def config_from_toml_text(text: str) -> Config:
    return from_dict(tomllib.loads(text))
