"""``gptoughts bench --compare torchtitan``: the same shape through torchtitan's Llama 3 and its ``parallelize_llama``
(or, for ``--model deepseek``, its DeepSeek-V3 and ``parallelize_deepseekv3``: ``bench_torchtitan_deepseek.py``) and
its training step, as its ``Trainer`` assembles them on one GPU, timed with the clock that times ours.

torchtitan is a peer we measure against, never a dependency: it is imported here only, on ``--compare
torchtitan``. The version is pinned because what follows calls its (young, fast-moving) internals by name; where it
calls a newer torch than the installed one, the shims below say what they change.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import torch

from gptoughts import models
from gptoughts.config import Config
from gptoughts.errors import ConfigError, UserError
from gptoughts.tools.bench_torchtitan_deepseek import (
    align_ours,
    check_torchtitan_deepseek_shape,
    import_torchtitan_deepseek,
    torchtitan_deepseek_config,
)
from gptoughts.tools.measure import SyntheticBatches, peak_memory, reset_memory, time_steps

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


def check_torchtitan_shape(family: str, args: Any) -> None:
    """A ConfigError (one line) when torchtitan's model of ``family`` has no equivalent of one of ``args``'s
    options: Llama 3 for the Llama-like families, DeepSeek-V3 for ``deepseek``."""
    if family == "deepseek":
        check_torchtitan_deepseek_shape(args)
    else:
        _check_torchtitan_shape(args)


def align_ours_with_torchtitan(cfg: Config) -> tuple[Config, list[str]]:
    """Before our run: ``cfg`` with what the compare turns off on our side
    (DeepSeek's sequence-wise balance loss, which torchtitan has none of) and a note per change; a refusal of any
    option the peer has no equivalent for, before anything is built or timed. A model loaded from ``init_from`` is
    checked after our run."""
    family = models.get_family(cfg.model.family).name
    if cfg.model.init_from is not None:
        return cfg, []
    overrides = dict(cfg.model.overrides)
    notes: list[str] = []
    if family == "deepseek":
        overrides, notes = align_ours(
            overrides, models.model_args(cfg.model.family, cfg.model.size, overrides)
        )
    check_torchtitan_shape(family, models.model_args(cfg.model.family, cfg.model.size, overrides))
    if not notes:
        return cfg, []
    return replace(cfg, model=replace(cfg.model, overrides=overrides)), notes


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
    return _fp8_converted(cfg, args.n_layers, fp8, fp8_bf16_end_layers, compiled, skip=["lm_head"])


def _fp8_converted(
    cfg: Any, n_layers: int, fp8: str | None, bf16_end_layers: int, compiled: bool, *, skip: list[str]
) -> Any:
    """``cfg`` through its ``Float8LinearConverter`` (as its float8 configs do), leaving out the ``skip`` modules
    and the ``bf16_end_layers`` first and last blocks; ``cfg`` itself without ``fp8``."""
    if not fp8:
        return cfg
    from torchtitan.components.quantization import Float8LinearConverter

    n, e = n_layers, bf16_end_layers
    keep = [f"layers.{i}." for i in range(n) if i < e or i >= n - e]
    # torchtitan 0.3.0 declares the rowwise recipes only; torchao's tensorwise (ours by default) goes through
    # the same converter (the recipe name is handed to torchao's Float8LinearConfig.from_recipe_name)
    conv = Float8LinearConverter.Config(
        recipe_name=fp8, filter_fqns=[*skip, *keep], model_compile_enabled=compiled
    )
    return conv.build().convert(cfg)


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


@dataclass
class _Peer:
    """torchtitan's model of one family at our shape: its config, the parallelize function its trainer calls, the
    hook its trainer registers on the optimizer (None: none), and their names for the label."""

    config: Any
    parallelize: Callable[..., Any]
    model_name: str
    register_hooks: Callable[[Any, Any, Any], None] | None = None
    hook_name: str = ""


def _peer(
    tt: SimpleNamespace,
    family: str,
    args: Any,
    block_size: int,
    *,
    attention: str,
    fp8: str | None,
    fp8_bf16_end_layers: int,
    compiled: bool,
) -> _Peer:
    """DeepSeek-V3 with ``parallelize_deepseekv3`` and its MoE load-balancing hook for ``deepseek``; Llama 3 with
    ``parallelize_llama`` for the others (refused there when not Llama-shaped)."""
    if family != "deepseek":
        cfg = torchtitan_llama_config(
            tt, args, block_size, attention=attention, fp8=fp8,
            fp8_bf16_end_layers=fp8_bf16_end_layers, compiled=compiled,
        )  # fmt: skip
        return _Peer(cfg, tt.parallelize_llama, "Llama3Model")
    if attention not in TORCHTITAN_MODES:
        raise ConfigError(f"torchtitan attention {attention!r}: one of {', '.join(TORCHTITAN_MODES)}")
    ds = import_torchtitan_deepseek()
    cfg = torchtitan_deepseek_config(tt, args, block_size, attention=attention)
    # like ours: the router gate (and the grouped experts, not Linear modules) stay out of fp8
    cfg = _fp8_converted(
        cfg, args.n_layers, fp8, fp8_bf16_end_layers, compiled, skip=["lm_head", "router.gate"]
    )
    hook = None
    if args.bias_update_rate > 0:

        def hook(opt: Any, model: Any, pdims: Any) -> None:
            ds.register_moe_load_balancing_hook(opt, [model], pdims)

    return _Peer(cfg, ds.parallelize, "DeepSeekV3Model", hook, "MoE load-balancing hook")


def bench_torchtitan(
    args: Any,
    batch_size: int,
    block_size: int,
    grad_accum: int,
    device: torch.device,
    precision: str,
    *,
    family: str = "llama",
    attention: str = "flex",
    compiled: bool = True,
    cuda_graphs: bool = True,
    activation_checkpointing: str = "none",
    fp8: str | None = None,
    fp8_bf16_end_layers: int = 0,
    ours_notes: list[str] | None = None,
    steps: int = 20,
    warmup: int = 5,
    seed: int = 0,
) -> dict[str, Any]:
    """The same shape through torchtitan's model of ``family`` (see :func:`_peer`) and its training step, as its
    ``Trainer`` assembles them on one GPU: built on meta, its parallelize (activation checkpointing, per-block
    compile, FSDP2 of degree 1 with its mixed-precision policy), ``to_empty`` + ``init_weights``, its chunked
    cross-entropy (compiled with the model), its forward+backward body (CUDA-graphed unless ``cuda_graphs`` is off,
    its default on), its optimizer hooks, its grad-norm clip, fused AdamW. Timed by :func:`time_steps`, like ours.
    ``ours_notes``: what the compare changed on our side, repeated in the label."""
    tt = import_torchtitan()
    _check_runnable(attention, device, block_size)
    mp = {"bf16": "bfloat16", "fp16": "float16"}.get(precision, "float32")
    torch.manual_seed(seed)
    peer = _peer(
        tt, family, args, block_size, attention=attention, fp8=fp8,
        fp8_bf16_end_layers=fp8_bf16_end_layers, compiled=compiled,
    )  # fmt: skip
    cuda_graphs = cuda_graphs and device.type == "cuda"
    ac = {"none": None, "full": tt.FullAC.Config(), "selective": tt.SelectiveAC.Config()}[
        activation_checkpointing
    ]
    reset_memory(device)
    with _one_process_group(tt, device) as pdims, tempfile.TemporaryDirectory() as dump:
        model, loss_fn, n_params = _parallelized_model(
            tt, peer, pdims, device, mp=mp, compiled=compiled, ac=ac, dump=dump, vocab=args.vocab_size
        )
        notes = list(tt.notes) + _old_fsdp_workarounds(model)
        step = _training_step(
            tt,
            model,
            loss_fn,
            pdims,
            SyntheticBatches(args.vocab_size, batch_size, block_size, device, seed=seed),
            batch_size=batch_size,
            block_size=block_size,
            grad_accum=grad_accum,
            device=device,
            flex=attention == "flex",
            cuda_graphs=cuda_graphs,
            register_hooks=peer.register_hooks,
        )
        try:
            step_s = time_steps(step, device, warmup, steps)
            peak = peak_memory(device)
        finally:
            if cuda_graphs:
                tt.cudagraph_teardown()  # its graphs hold this model: free them before the next run
    notes += [f"ours: {n}" for n in ours_notes or []]
    return {
        "mode": attention,
        "label": _label(tt, peer, attention, mp, compiled, ac, fp8, cuda_graphs, notes),
        "params": n_params,
        "step_ms": step_s * 1e3,
        "tokens_per_s": batch_size * block_size * grad_accum / step_s,
        "peak_memory_gib": peak,
    }


def _check_runnable(attention: str, device: torch.device, block_size: int) -> None:
    if attention == "flex" and device.type != "cuda":
        raise RuntimeError(
            f"FlexAttention has no backward on {device.type} (torch's limit); torchtitan:sdpa runs here"
        )
    if block_size % 8:
        raise ConfigError(
            f"--compare torchtitan: its chunked loss splits the sequence in 8; block {block_size}"
        )


def _parallelized_model(
    tt: SimpleNamespace,
    peer: _Peer,
    pdims: Any,
    device: torch.device,
    *,
    mp: str,
    compiled: bool,
    ac: Any,
    dump: str,
    vocab: int,
) -> tuple[Any, Any, int]:
    """Its model built on meta, through its parallelize, materialised and initialised on ``device``, and its
    chunked loss holding the LM head (as its trainer wires them); also the parameter count."""
    compile_config = tt.CompileConfig(enable=compiled)  # components: model (per block) and loss, its default
    with torch.device("meta"):
        model = peer.config.build()
    n_params = sum(p.numel() for p in model.parameters())
    model = peer.parallelize(
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
    loss_fn = tt.ChunkedLossWrapper.Config(loss_fn=tt.CrossEntropyLoss.Config(global_vocab_size=vocab)).build(
        compile_config=compile_config
    )
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    return model, loss_fn, n_params


def _old_fsdp_workarounds(model: Any) -> list[str]:
    """What torch before 2.13 needs for its chunked loss under FSDP2 (nothing on newer torch): the notes saying so."""
    if _torch_version() >= (2, 13):
        return []
    # With torch 2.11's FSDP2 the wrapper's closing `lm_head.reshard()` frees the unsharded weight of the final
    # norm (the same FSDP unit) before the decoder's backward reads it: a segfault on CPU, found on torch 2.11 and
    # not on 2.13. Kept unsharded instead (one more bf16 copy of norm + lm_head resident).
    model.lm_head.reshard = lambda: None
    # torch 2.11's FSDP2 also reduces the [norm, lm_head] unit only once, in the decoder's backward (2.13 detects
    # the lm_head-only forwards of the chunk loop): the wrapper's no-sync chunks 0..6 have by then upcast lm_head's
    # gradient to the fp32 reduce dtype while norm's is bf16, and that one reduce-scatter refuses the mix. Kept
    # syncing instead: lm_head's chunk gradients stay bf16 like norm's and are reduced (in fp32, into the fp32
    # sharded .grad) at each post-backward 2.11 fires for the unit, a few times a step; in fp32 the gradients are
    # the same either way.
    model.lm_head.set_requires_gradient_sync = lambda *a, **k: None
    return [
        f"torch {torch.__version__.split('+')[0]}: the chunked loss's lm_head.reshard() and no-sync chunks skipped"
    ]


def _training_step(
    tt: SimpleNamespace,
    model: Any,
    loss_fn: Any,
    pdims: Any,
    data: SyntheticBatches,
    *,
    batch_size: int,
    block_size: int,
    grad_accum: int,
    device: torch.device,
    flex: bool,
    cuda_graphs: bool,
    register_hooks: Callable[[Any, Any, Any], None] | None = None,
) -> Callable[[], None]:
    """One optimizer step as its trainer takes it: ``grad_accum`` forward+backward bodies (CUDA-graphed when
    ``cuda_graphs``), its grad-norm clip, fused AdamW with the hooks ``register_hooks(opt, model, pdims)`` puts
    on it (its trainer's ``post_optimizer_build_fn``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda")
    if register_hooks is not None:
        register_hooks(opt, model, pdims)
    # its data loader gives each token its position in its document: one document per synthetic row
    positions = torch.arange(block_size, device=device).expand(batch_size, block_size).contiguous()
    # the step's token count stays on the device (no sync), as in its trainer
    n_tokens = torch.tensor(batch_size * block_size * grad_accum, device=device)
    context = tt.dist_utils.get_spmd_context(parallel_dims=pdims)

    def fwd_bwd(x: torch.Tensor, y: torch.Tensor, gvt: torch.Tensor, extra: dict[str, Any]) -> torch.Tensor:
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
            if flex:  # its post_dataloading_process: the block mask, every micro-batch
                extra["attention_masks"] = model.get_attention_masks(positions=positions)
            x, y, extra = tt.annotate_input_spmd_types(pdims, x, y, extra)
            body(x, y, n_tokens, extra)
        tt.dist_utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        # with CUDA graphs the gradients stay allocated (the graph writes into them), as in its trainer
        opt.zero_grad(set_to_none=not cuda_graphs)

    return step


def _label(
    tt: SimpleNamespace,
    peer: _Peer,
    attention: str,
    mp: str,
    compiled: bool,
    ac: Any,
    fp8: str | None,
    cuda_graphs: bool,
    notes: list[str],
) -> str:
    """What was run on torchtitan's side, in one line for the result."""
    parts = [
        f"torchtitan {tt.tt_version}",
        f"{peer.model_name}, {attention} attention",
        f"{peer.parallelize.__name__}: FSDP2 x1 {mp}",
        "compile per block + loss"
        if compiled
        else "no compile" + (" (its flex_attention is compiled always)" if attention == "flex" else ""),
    ]
    if ac is not None:
        parts.append(f"{type(ac).__qualname__.split('.')[0]}")
    if fp8:
        parts.append(f"Float8LinearConverter {fp8}")
    if peer.register_hooks is not None:
        parts.append(peer.hook_name)
    parts.append("CUDA-graphed fwd+bwd" if cuda_graphs else "no CUDA graphs")
    return "; ".join(parts + notes)
