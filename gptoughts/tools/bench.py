"""``gptoughts bench``: tokens/s, MFU, peak memory and the step breakdown of one configuration, optionally
side by side, in the same process and at the same shape, with ``transformers`` (``LlamaForCausalLM``, eager and
compiled: ``--compare hf``) or with torchtitan's own Llama 3 and its own ``parallelize_llama`` (``--compare
torchtitan``; torchtitan is not a dependency: it is imported only then).

The timed step is the trainer's own ``train_step`` (same precision handling, fused AdamW, gradient clipping and
accumulation), so what bench reports is what ``train`` runs.
"""

from __future__ import annotations

import contextlib
import gc
import math
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from gptoughts import models
from gptoughts.config import Config
from gptoughts.errors import ConfigError, UserError


class SyntheticBatches:
    """Random token windows generated once on the device: the data never waits (pure model speed)."""

    def __init__(
        self,
        vocab_size: int,
        batch_size: int,
        block_size: int,
        device: torch.device,
        seed: int = 0,
        pool: int = 8,
    ):
        g = torch.Generator(device="cpu").manual_seed(seed)
        data = torch.randint(0, vocab_size, (pool, batch_size, block_size + 1), generator=g)
        self.batches = [(d[:, :-1].to(device), d[:, 1:].to(device)) for d in data]
        self.i = 0

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.batches[self.i % len(self.batches)]
        self.i += 1
        return b

    def state_dict(self) -> dict:
        return {"i": self.i}

    def close(self) -> None:
        pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_memory(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return None


def time_steps(step_fn, device: torch.device, warmup: int, steps: int) -> float:
    """Seconds per step: warm-up (compilation, allocator growth) excluded, one sync around the timed steps."""
    for _ in range(warmup):
        step_fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step_fn()
    _sync(device)
    return (time.perf_counter() - t0) / steps


def profile_steps(step_fn, device: torch.device, steps: int) -> dict[str, Any] | None:
    """GPU time per step by kernel category over ``steps`` profiled steps (None off CUDA)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    from gptoughts.perf.timing import summarize_profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step_fn()
        _sync(device)
        wall = time.perf_counter() - t0
    out = summarize_profile(prof, steps)
    out["step_ms_profiled"] = wall * 1e3 / steps
    return out


def run_bench(
    cfg: Config,
    *,
    steps: int = 20,
    warmup: int = 5,
    compare: str | None = None,
    data_dir: str | None = None,
    hf_modes: tuple[str, ...] = ("eager", "compiled"),
    kernel_steps: int = 0,
) -> dict[str, Any]:
    """Time ``cfg``'s training step; ``compare``: ``hf``, or ``torchtitan[:MODE,...]`` (see
    :func:`parse_torchtitan_compare`), run after ours on the same shape, batch and precision."""
    tt_modes: tuple[str, ...] = ()
    tt_graphs = True
    if compare is not None and compare != "hf":
        tt_modes, tt_graphs = parse_torchtitan_compare(compare)
        # Before anything is built or timed: a missing peer is said in one line at once, not after our run.
        import_torchtitan()
    from gptoughts.data.tokenizer import tokenizer_before_training
    from gptoughts.training.build import (
        build_model,
        plan_batches,
        setup_environment,
        synthetic_data,
        timing_trainer,
        use_our_compile_cache,
    )

    env = setup_environment(cfg)
    use_our_compile_cache()
    device, hw, precision = env.device, env.hw, env.precision
    family = models.get_family(cfg.model.family)
    # The vocabulary train would build for this size's tokenizer (bpe:8192 at debug, bytes: 259 rounded up to 320),
    # or the prepared shards' own: the model's default would time another model than `train --size S` trains.
    if data_dir is not None:
        from gptoughts.data.loader import TokenDataset

        tokenizer, vocab = None, TokenDataset(data_dir).vocab_size
    else:
        tokenizer, vocab = tokenizer_before_training(cfg.data.tokenizer)
    _reset_memory(device)
    data = synthetic_data(vocab, tokenizer=tokenizer)
    model = build_model(cfg, env, data)  # the train assembly's own step: transforms in their one order
    batch = plan_batches(cfg, env, data, model)  # batch_size = auto: the same search as train
    t = replace(cfg.train, batch_size=batch.micro_batch, grad_accum=batch.grad_accum)
    if data_dir is not None:
        from gptoughts.data.loader import BatchLoader

        loader: Any = BatchLoader(
            TokenDataset(data_dir),
            split="train",
            batch_size=t.batch_size,
            block_size=t.block_size,
            seed=t.seed,
            device=device,
        )
    else:
        loader = SyntheticBatches(vocab, t.batch_size, t.block_size, device, seed=t.seed)
    trainer = timing_trainer(cfg, env, model, loader, batch)
    # The breakdown comes from the CUDA events of the timed steps themselves (they cost nothing measurable), and
    # what the events do not cover (host time between steps) is reported as "other": the parts add up to the
    # headline step time.
    for _ in range(warmup):
        trainer.train_step()
    trainer.timer.pending.clear()
    step_s = time_steps(trainer.train_step, device, 0, steps)
    breakdown = _breakdown(trainer.timer.summary(), step_s * 1e3)
    kernels = profile_steps(trainer.train_step, device, kernel_steps) if kernel_steps > 0 else None
    tokens_per_step = batch.tokens_per_step
    tps = tokens_per_step / step_s
    raw, args = model.raw, model.args
    flops_tok = raw.flops_per_token(t.block_size)
    peak = hw.peak_bf16_flops
    result: dict[str, Any] = {
        "family": family.name,
        "size": cfg.model.size,
        "device": hw.name,
        "precision": precision,
        "compile": cfg.perf.compile,
        "batch_size": t.batch_size,
        "block_size": t.block_size,
        "grad_accum": t.grad_accum,
        "params": raw.num_params(),
        "params_non_embedding": raw.num_params(True),
        "flops_per_token": flops_tok,
        "step_ms": step_s * 1e3,
        "tokens_per_s": tps,
        "mfu": (flops_tok * tps / peak) if peak else None,
        "peak_memory_gib": _peak_memory(device),
        "breakdown": breakdown,
        "data": "shards" if data_dir else "synthetic",
    }
    result["resolved"] = {**model.built.resolved, **batch.why}
    if kernels is not None:
        result["kernels"] = kernels
    loader.close()
    del trainer, model, raw, loader
    _reset_memory(device)

    if compare == "hf":
        result["hf"] = {}
        for mode in hf_modes:
            if mode == "compiled" and not (hw.compile and result["resolved"].get("compile")):
                continue  # like with like: transformers is compiled only when our side is
            r = bench_hf(
                args,
                t.batch_size,
                t.block_size,
                t.grad_accum,
                device,
                precision,
                mode=mode,
                steps=steps,
                warmup=warmup,
                seed=t.seed,
            )
            r["mfu"] = (flops_tok * r["tokens_per_s"] / peak) if peak else None
            r["speedup"] = tps / r["tokens_per_s"]
            result["hf"][mode] = r
            _reset_memory(device)
    elif tt_modes:
        res = result["resolved"]
        compiled = bool(hw.compile and res.get("compile"))  # like with like: compiled only when ours is
        result["torchtitan"] = {}
        for mode in tt_modes:
            try:
                r = bench_torchtitan(
                    args,
                    t.batch_size,
                    t.block_size,
                    t.grad_accum,
                    device,
                    precision,
                    attention=mode,
                    compiled=compiled,
                    cuda_graphs=tt_graphs,
                    activation_checkpointing=str(res.get("activation_checkpointing", "none")),
                    fp8=res.get("fp8") or None,
                    fp8_bf16_end_layers=cfg.perf.fp8_bf16_end_layers,
                    steps=steps,
                    warmup=warmup,
                    seed=t.seed,
                )
            except UserError:
                raise
            except Exception as e:
                # the peer failing (a torch API it expects, a kernel) must not lose our measurement: said in the output
                r = {"mode": mode, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            if "tokens_per_s" in r:
                r["mfu"] = (flops_tok * r["tokens_per_s"] / peak) if peak else None
                r["speedup"] = tps / r["tokens_per_s"]
            result["torchtitan"][mode] = r
            _reset_memory(device)
    return result


def _breakdown(events: dict[str, float], step_ms: float) -> dict[str, float]:
    """The per-phase means of the timed steps, with the time their events do not cover added to "other", as
    shares of the measured step (so the parts sum to the headline step time)."""
    if not events:
        return {}
    from gptoughts.perf.timing import PHASES

    out = {f"time/{k}_ms": events.get(f"time/{k}_ms", 0.0) for k in PHASES}
    out["time/other_ms"] += max(0.0, step_ms - sum(out.values()))
    out["time/step_ms"] = step_ms
    for k in PHASES:
        out[f"time/{k}_pct"] = 100.0 * out[f"time/{k}_ms"] / step_ms if step_ms > 0 else 0.0
    return out


def hf_llama_config(args: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=args.d_model,
        intermediate_size=args.ffn_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.max_seq_len,
        rope_theta=args.rope_theta,
        rms_norm_eps=args.norm_eps,
        tie_word_embeddings=args.tie_embeddings,
        attention_bias=args.qkv_bias,
        head_dim=args.d_model // args.n_heads,
    )


def bench_hf(
    args: Any,
    batch_size: int,
    block_size: int,
    grad_accum: int,
    device: torch.device,
    precision: str,
    *,
    mode: str,
    steps: int,
    warmup: int,
    seed: int,
) -> dict[str, Any]:
    """The same shape through transformers' LlamaForCausalLM: fp32 weights, autocast, fused AdamW, its own loss."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    hf_cfg = hf_llama_config(args)
    hf_cfg._attn_implementation = "sdpa"
    model: nn.Module = LlamaForCausalLM(hf_cfg).to(device)
    model.train()
    step_model = torch.compile(model) if mode == "compiled" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    data = SyntheticBatches(args.vocab_size, batch_size, block_size + 0, device, seed=seed)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def step() -> None:
        for _ in range(grad_accum):
            x, y = next(data)
            ctx = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
            with ctx:
                out = step_model(input_ids=x, labels=x)
            (out.loss / grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    _reset_memory(device)
    step_s = time_steps(step, device, warmup, steps)
    res = {
        "mode": mode,
        "step_ms": step_s * 1e3,
        "tokens_per_s": batch_size * block_size * grad_accum / step_s,
        "peak_memory_gib": _peak_memory(device),
    }
    return res


# --- torchtitan -------------------------------------------------------------------------------------------------
# torchtitan is a peer we measure against, never a dependency: it is imported here only, on `--compare torchtitan`.
# The version is pinned because what follows calls its (young, fast-moving) internals by name.

TORCHTITAN_VERSION = "0.3.0"
TORCHTITAN_MODES = ("flex", "sdpa")
"""Attention of torchtitan's model: ``flex`` is what its Llama 3 uses for language models (FlexAttention, with a
causal + document block mask built each step, compiled with max-autotune); ``sdpa`` is its own
``ScaledDotProductAttention`` module (``is_causal``, cuDNN then flash: the kernels our model reaches through SDPA)
put in the same place (torchtitan builds it for Flux; our synthetic rows are one document each, so the two masks
are the same)."""


def torchtitan_install_hint(reason: str) -> str:
    return (
        f"--compare torchtitan needs torchtitan {TORCHTITAN_VERSION}, which gptoughts does not install ({reason}): "
        f"pip install torchtitan=={TORCHTITAN_VERSION}; without network, run `bash bench/peer_wheels.sh` where there "
        "is one, carry .whl/ over, `pip install --no-deps --target .peer .whl/*.whl` and run with PYTHONPATH=.peer"
    )


def parse_torchtitan_compare(compare: str) -> tuple[tuple[str, ...], bool]:
    """``torchtitan`` -> both attentions with torchtitan's default CUDA-graphed forward+backward;
    ``torchtitan:flex``, ``torchtitan:sdpa,nographs`` ... pick them (``nographs``: its
    ``training.disable_cuda_graphs``)."""
    name, _, rest = compare.partition(":")
    if name != "torchtitan":
        raise ConfigError(f"--compare {compare!r}: `hf` or `torchtitan` (e.g. torchtitan:flex,sdpa,nographs)")
    words = [w for w in rest.split(",") if w] if rest else []
    bad = [w for w in words if w not in (*TORCHTITAN_MODES, "nographs")]
    if bad:
        raise ConfigError(
            f"--compare {compare!r}: unknown {bad[0]!r}; after `torchtitan:` name any of "
            f"{', '.join(TORCHTITAN_MODES)}, nographs"
        )
    modes = tuple(w for w in words if w in TORCHTITAN_MODES) or TORCHTITAN_MODES
    return modes, "nographs" not in words


def _torch_shims() -> list[str]:
    """Names torchtitan 0.3.0 imports that the installed torch lacks, added as placeholders. Only one is needed with
    torch 2.11: ``torch.distributed.fsdp.DataParallelMeshDims`` (newer torch), imported by its fsdp module but
    constructed only for meshes of more than one device (``full_dtensor.resolve_fsdp_mesh`` returns None for a
    one-device mesh), so the one-GPU path never touches the placeholder."""
    import torch.distributed.fsdp as fsdp

    notes = []
    if not hasattr(fsdp, "DataParallelMeshDims"):

        class DataParallelMeshDims:  # placeholder, see above
            def __init__(self, *a: Any, **k: Any) -> None:
                raise RuntimeError(
                    "torchtitan asked for DataParallelMeshDims, which this torch does not have"
                )

        fsdp.DataParallelMeshDims = DataParallelMeshDims  # type: ignore[attr-defined]
        notes.append(f"torch {torch.__version__.split('+')[0]} lacks fsdp.DataParallelMeshDims: placeholder")
    return notes


def _torchtitan_shims() -> list[str]:
    """Where torchtitan 0.3.0 calls a newer torch than the installed one with an argument whose value is the
    installed torch's only behaviour, the argument is dropped (checked on torch 2.11): ``create_block_mask``'s
    ``separate_full_blocks=True`` (its flex block mask; torch 2.11 always separates the full blocks)."""
    import inspect

    from torch.nn.attention.flex_attention import create_block_mask

    notes = []
    if "separate_full_blocks" not in inspect.signature(create_block_mask).parameters:
        import torchtitan.models.common.decoder as decoder

        inner = decoder.create_attention_mask

        def create_attention_mask(*args: Any, separate_full_blocks: bool = True, **kwargs: Any) -> Any:
            if not separate_full_blocks:
                raise RuntimeError("this torch's create_block_mask always separates the full blocks")
            return inner(*args, **kwargs)

        decoder.create_attention_mask = create_attention_mask
        notes.append(
            f"torch {torch.__version__.split('+')[0]} create_block_mask lacks separate_full_blocks: dropped"
        )
    return notes


_TT: SimpleNamespace | None = None


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def import_torchtitan() -> SimpleNamespace:
    """torchtitan's pieces used by :func:`bench_torchtitan`, imported once; a UserError (one line: how to install
    it) when it or one of its import-time dependencies (spmd_types, tyro, triton) is missing."""
    global _TT
    if _TT is not None:
        return _TT
    try:
        import torchtitan  # noqa: F401
    except ImportError as e:
        raise UserError(torchtitan_install_hint(str(e))) from None
    notes = _torch_shims()
    try:
        import torchtitan.models.llama3 as llama3
        from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import parallel_dims as parallel_dims_module
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
        from torchtitan.distributed.cudagraph import cudagraph_teardown, wrap_with_cuda_graph
        from torchtitan.distributed.spmd_types import annotate_input_spmd_types
        from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
        from torchtitan.models.common.attention import ScaledDotProductAttention
        from torchtitan.models.llama3.parallelize import parallelize_llama
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config
    except ModuleNotFoundError as e:
        raise UserError(torchtitan_install_hint(str(e))) from None
    except Exception as e:  # an API of this torch that torchtitan expects and does not find
        raise UserError(
            f"torchtitan {TORCHTITAN_VERSION} does not load with torch {torch.__version__}: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    notes += _torchtitan_shims()
    from importlib.metadata import PackageNotFoundError, version

    try:
        tt_version = version("torchtitan")
    except PackageNotFoundError:
        tt_version = "?"
    _TT = SimpleNamespace(
        llama3=llama3,
        ChunkedLossWrapper=ChunkedLossWrapper,
        CrossEntropyLoss=CrossEntropyLoss,
        CompileConfig=CompileConfig,
        ParallelismConfig=ParallelismConfig,
        TrainingConfig=TrainingConfig,
        ParallelDims=ParallelDims,
        parallel_dims_module=parallel_dims_module,
        dist_utils=dist_utils,
        FullAC=FullAC,
        SelectiveAC=SelectiveAC,
        cudagraph_teardown=cudagraph_teardown,
        wrap_with_cuda_graph=wrap_with_cuda_graph,
        annotate_input_spmd_types=annotate_input_spmd_types,
        ComplexRoPE=ComplexRoPE,
        Embedding=Embedding,
        Linear=Linear,
        RMSNorm=RMSNorm,
        ScaledDotProductAttention=ScaledDotProductAttention,
        parallelize_llama=parallelize_llama,
        set_llama3_sharding_config=set_llama3_sharding_config,
        tt_version=tt_version,
        notes=notes,
    )
    return _TT


def _check_torchtitan_shape(args: Any) -> None:
    """torchtitan's Llama 3 has no knob for these; the compare would not be the same model."""
    unsupported = {
        "qkv_bias": bool(getattr(args, "qkv_bias", False)),
        "qk_norm": bool(getattr(args, "qk_norm", False)),
        "sliding_window": getattr(args, "sliding_window", None) is not None,
        "head_dim": getattr(args, "head_dim", None) not in (None, args.d_model // args.n_heads),
        "mlp": getattr(args, "mlp", "swiglu") != "swiglu",
    }
    for name, on in unsupported.items():
        if on:
            raise ConfigError(
                f"--compare torchtitan: torchtitan's Llama 3 has no equivalent of model.{name} = "
                f"{getattr(args, name)!r}; compare a plain Llama shape"
            )


def torchtitan_llama_config(
    tt: SimpleNamespace,
    args: Any,
    block_size: int,
    *,
    attention: str = "flex",
    fp8: str | None = None,
    fp8_bf16_end_layers: int = 0,
    compiled: bool = False,
) -> Any:
    """torchtitan's ``Llama3Model.Config`` at our shape, built with its own layer builder and inits (as its
    ``llama3_configs`` flavours are), its sharding declarations (as its trainer's ``update_from_config`` sets them),
    and, with ``fp8``, its ``Float8LinearConverter`` (as its float8 configs do: ``lm_head`` left out)."""
    _check_torchtitan_shape(args)
    if attention not in TORCHTITAN_MODES:
        raise ConfigError(f"torchtitan attention {attention!r}: one of {', '.join(TORCHTITAN_MODES)}")
    d, v = args.d_model, args.vocab_size
    L = tt.llama3
    layers = L._build_llama3_layers(
        n_layers=args.n_layers,
        dim=d,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        hidden_dim=args.ffn_dim,
        # RoPE tables sized to the run, as its trainer's update_from_config does; rope scaling changes only the
        # precomputed table, not the step
        rope=tt.ComplexRoPE.Config(dim=d // args.n_heads, max_seq_len=block_size, theta=args.rope_theta),
        fuse_qkv=True,
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention_norm.eps = layer.ffn_norm.eps = args.norm_eps
        if attention == "sdpa":
            layer.attention.inner_attention = tt.ScaledDotProductAttention.Config()
    cfg = L.Llama3Model.Config(
        dim=d,
        vocab_size=v,
        enable_weight_tying=bool(args.tie_embeddings),
        tok_embeddings=tt.Embedding.Config(
            num_embeddings=v,
            embedding_dim=d,
            param_init=L._EMBEDDING_SKIP_INIT if args.tie_embeddings else L._EMBEDDING_INIT,
        ),
        norm=tt.RMSNorm.Config(normalized_shape=d, eps=args.norm_eps, param_init=L._NORM_INIT),
        lm_head=tt.Linear.Config(in_features=d, out_features=v, param_init=L._output_linear_init(d)),
        layers=layers,
    )
    tt.set_llama3_sharding_config(cfg, enable_sp=tt.ParallelismConfig().enable_sequence_parallel)
    if fp8:
        from torchtitan.components.quantization import Float8LinearConverter

        n = args.n_layers
        keep = [f"layers.{i}." for i in range(n) if i < fp8_bf16_end_layers or i >= n - fp8_bf16_end_layers]
        # torchtitan 0.3.0 declares the rowwise recipes only; torchao's tensorwise (ours by default) goes through
        # the same converter (the recipe name is handed to torchao's Float8LinearConfig.from_recipe_name)
        conv = Float8LinearConverter.Config(
            recipe_name=fp8, filter_fqns=["lm_head", *keep], model_compile_enabled=compiled
        )
        cfg = conv.build().convert(cfg)
    return cfg


@contextlib.contextmanager
def _one_process_group(tt: SimpleNamespace, device: torch.device) -> Iterator[Any]:
    """A process group of one and torchtitan's ``ParallelDims`` for one device: its parallelize always applies
    FSDP2 (degree 1), which is how it trains in bf16 (MixedPrecisionPolicy), so it needs a mesh even on one GPU."""
    import torch.distributed as dist

    created = False
    if dist.is_initialized():
        if dist.get_world_size() > 1:
            raise ConfigError("--compare torchtitan runs on one process: launch bench without torchrun")
    else:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
        )
        created = True
    # torchtitan picks its mesh device type at import: "cuda" even on a machine without a GPU (tests on CPU)
    pd_mod, old = tt.parallel_dims_module, tt.parallel_dims_module.device_type
    pd_mod.device_type = device.type
    try:
        yield tt.ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    finally:
        pd_mod.device_type = old
        if created:
            dist.destroy_process_group()


def bench_torchtitan(
    args: Any,
    batch_size: int,
    block_size: int,
    grad_accum: int,
    device: torch.device,
    precision: str,
    *,
    attention: str = "flex",
    compiled: bool = True,
    cuda_graphs: bool = True,
    activation_checkpointing: str = "none",
    fp8: str | None = None,
    fp8_bf16_end_layers: int = 0,
    steps: int = 20,
    warmup: int = 5,
    seed: int = 0,
) -> dict[str, Any]:
    """The same shape through torchtitan's Llama 3 and its training step, as its ``Trainer`` assembles them on one
    GPU: built on meta, ``parallelize_llama`` (activation checkpointing, per-block compile, FSDP2 of degree 1 with
    its mixed-precision policy), ``to_empty`` + ``init_weights``, its chunked cross-entropy (compiled with the model),
    its forward+backward body (CUDA-graphed unless ``cuda_graphs`` is off, its default on), its grad-norm clip,
    fused AdamW. Timed by :func:`time_steps`, like ours."""
    tt = import_torchtitan()
    if attention == "flex" and device.type != "cuda":
        raise RuntimeError(
            f"FlexAttention has no backward on {device.type} (torch's limit); torchtitan:sdpa runs here"
        )
    if block_size % 8:
        raise ConfigError(
            f"--compare torchtitan: its chunked loss splits the sequence in 8; block {block_size}"
        )
    mp = {"bf16": "bfloat16", "fp16": "float16"}.get(precision, "float32")
    torch.manual_seed(seed)
    cfg = torchtitan_llama_config(
        tt,
        args,
        block_size,
        attention=attention,
        fp8=fp8,
        fp8_bf16_end_layers=fp8_bf16_end_layers,
        compiled=compiled,
    )
    cuda_graphs = cuda_graphs and device.type == "cuda"
    ac = {"none": None, "full": tt.FullAC.Config(), "selective": tt.SelectiveAC.Config()}[
        activation_checkpointing
    ]
    compile_config = tt.CompileConfig(enable=compiled)  # components: model (per block) and loss, its default
    _reset_memory(device)
    with _one_process_group(tt, device) as pdims, tempfile.TemporaryDirectory() as dump:
        with torch.device("meta"):
            model = cfg.build()
        n_params = sum(p.numel() for p in model.parameters())
        model = tt.parallelize_llama(
            model,
            parallel_dims=pdims,
            training=tt.TrainingConfig(mixed_precision_param=mp, mixed_precision_reduce="float32"),
            parallelism=tt.ParallelismConfig(),
            compile_config=compile_config,
            ac_config=ac,
            dump_folder=dump,
        )
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model.train()
        loss_fn = tt.ChunkedLossWrapper.Config(
            loss_fn=tt.CrossEntropyLoss.Config(global_vocab_size=args.vocab_size)
        ).build(compile_config=compile_config)
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
        notes = list(tt.notes)
        if _torch_version() < (2, 13):
            # With torch 2.11's FSDP2 the wrapper's closing `lm_head.reshard()` frees the unsharded weight of the
            # final norm (the same FSDP unit) before the decoder's backward reads it: a segfault on CPU, found on
            # torch 2.11 and not on 2.13. Kept unsharded instead (one more bf16 copy of norm + lm_head resident).
            model.lm_head.reshard = lambda: None
            # torch 2.11's FSDP2 also reduces the [norm, lm_head] unit only once, in the decoder's backward
            # (2.13 detects the lm_head-only forwards of the chunk loop): the wrapper's no-sync chunks 0..6 have by
            # then upcast lm_head's gradient to the fp32 reduce dtype while norm's is bf16, and that one reduce-
            # scatter refuses the mix. Kept syncing instead: lm_head's chunk gradients stay bf16 like norm's and are
            # reduced (in fp32, into the fp32 sharded .grad) at each post-backward 2.11 fires for the unit, a few times
            # a step; in fp32 the gradients are the same either way.
            model.lm_head.set_requires_gradient_sync = lambda *a, **k: None
            notes.append(
                f"torch {torch.__version__.split('+')[0]}: the chunked loss's lm_head.reshard() and no-sync "
                "chunks skipped"
            )
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(
            params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda"
        )
        data = SyntheticBatches(args.vocab_size, batch_size, block_size, device, seed=seed)
        # its data loader gives each token its position in its document: one document per synthetic row
        positions = torch.arange(block_size, device=device).expand(batch_size, block_size).contiguous()
        # the step's token count stays on the device (no sync), as in its trainer
        n_tokens = torch.tensor(batch_size * block_size * grad_accum, device=device)
        context = tt.dist_utils.get_spmd_context(parallel_dims=pdims)

        def fwd_bwd(
            x: torch.Tensor, y: torch.Tensor, gvt: torch.Tensor, extra: dict[str, Any]
        ) -> torch.Tensor:
            # its Trainer._forward_backward_body
            with context():
                pred = model(x, **extra)
                loss, _ = loss_fn(pred, y, gvt, positions=extra["positions"])
                del pred
                loss.backward()
            return loss

        body = tt.wrap_with_cuda_graph(fwd_bwd) if cuda_graphs else fwd_bwd

        def step() -> None:
            for _ in range(grad_accum):
                x, y = next(data)
                extra: dict[str, Any] = {"positions": positions}
                if attention == "flex":  # its post_dataloading_process: the block mask, every micro-batch
                    extra["attention_masks"] = model.get_attention_masks(positions=positions)
                x, y, extra = tt.annotate_input_spmd_types(pdims, x, y, extra)
                body(x, y, n_tokens, extra)
            tt.dist_utils.clip_grad_norm_(params, 1.0, foreach=True)
            opt.step()
            # with CUDA graphs the gradients stay allocated (the graph writes into them), as in its trainer
            opt.zero_grad(set_to_none=not cuda_graphs)

        try:
            step_s = time_steps(step, device, warmup, steps)
            peak = _peak_memory(device)
        finally:
            if cuda_graphs:
                tt.cudagraph_teardown()  # its graphs hold this model: free them before the next run
    parts = [
        f"torchtitan {tt.tt_version}",
        f"Llama3Model, {attention} attention",
        f"parallelize_llama: FSDP2 x1 {mp}",
        "compile per block + loss"
        if compiled
        else "no compile" + (" (its flex_attention is compiled always)" if attention == "flex" else ""),
    ]
    if ac is not None:
        parts.append(f"{type(ac).__qualname__.split('.')[0]}")
    if fp8:
        parts.append(f"Float8LinearConverter {fp8}")
    parts.append("CUDA-graphed fwd+bwd" if cuda_graphs else "no CUDA graphs")
    parts += notes
    return {
        "mode": attention,
        "label": "; ".join(parts),
        "params": n_params,
        "step_ms": step_s * 1e3,
        "tokens_per_s": batch_size * block_size * grad_accum / step_s,
        "peak_memory_gib": peak,
    }


def format_result(r: dict[str, Any]) -> str:
    def f(v: Any, spec: str) -> str:
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    lines = [
        f"{r['family']}/{r['size']} on {r['device']} ({r['precision']}, compile={r['compile']}): "
        f"batch {r['batch_size']} x {r['block_size']} x accum {r['grad_accum']}, {r['params'] / 1e6:.1f}M params",
        f"  tokens/s {f(r['tokens_per_s'], ',.0f')}   step {f(r['step_ms'], '.1f')} ms   MFU {f(r['mfu'], '.3f')}   "
        f"peak memory {f(r['peak_memory_gib'], '.2f')} GiB   ({r['data']} data)",
    ]
    b = r.get("breakdown") or {}
    if b:
        parts = [
            f"{k} {b.get(f'time/{k}_ms', 0):.1f} ms ({b.get(f'time/{k}_pct', 0):.0f}%)"
            for k in ("data", "forward", "backward", "optimizer", "other")
        ]
        lines.append("  breakdown: " + ", ".join(parts))
    if r.get("kernels"):
        from gptoughts.perf.timing import format_profile

        lines += ["  " + line for line in format_profile(r["kernels"])]
    for mode, h in (r.get("hf") or {}).items():
        lines.append(
            f"  transformers {mode}: tokens/s {f(h['tokens_per_s'], ',.0f')}  MFU {f(h['mfu'], '.3f')}  "
            f"peak {f(h['peak_memory_gib'], '.2f')} GiB  -> ours is {h['speedup']:.2f}x"
        )
    for mode, h in (r.get("torchtitan") or {}).items():
        if "error" in h:
            lines.append(f"  torchtitan {mode}: failed: {h['error']}")
            continue
        params = (
            ""
            if h["params"] == r["params"]
            else f"  ({h['params'] / 1e6:.1f}M params, ours {r['params'] / 1e6:.1f}M)"
        )
        lines.append(
            f"  torchtitan {mode}: tokens/s {f(h['tokens_per_s'], ',.0f')}  MFU {f(h['mfu'], '.3f')}  "
            f"peak {f(h['peak_memory_gib'], '.2f')} GiB  -> ours is {h['speedup']:.2f}x{params}"
        )
        lines.append(f"    [{h['label']}]")
    return "\n".join(lines)
