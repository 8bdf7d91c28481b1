"""What a run will need, estimated before anything heavy is built: its peak memory on the device (and the host's,
under offload), the memory layout search over the settings left to their defaults, and its speed."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from gptoughts.perf.layout import Layout, LayoutSearch, Need, fixed_layout, gib_figure


def estimate_peak(
    cfg: Any,
    env: Any,
    model: Any,
    micro_batch: int,
    block_size: int,
    world_size: int,
    tp: int = 1,
    grad_accum: int | None = None,
) -> Any:
    """``perf/estimate.py``'s estimate of one training step at ``micro_batch`` (native families trained in full;
    None for LoRA, generic transformers models and pipelines, which it does not model). ``grad_accum``: the step's
    accumulation (None: :func:`accumulation`'s guess from the config, before the batch is planned)."""
    if (
        cfg.lora.enabled
        or not hasattr(model.args, "__dataclass_fields__")
        or model.pretrained is not None
        and model.pretrained.generic
        or env.dist.pp
        > 1  # the estimate knows no pipeline stages (it printed 227 GiB for 100 measured at 8b)
    ):
        return None
    from gptoughts.perf import checkpointing
    from gptoughts.perf.ce import loss_rule
    from gptoughts.perf.estimate import estimate
    from gptoughts.training.optim import records_muon_step

    # DPO runs the chosen and the rejected completion of each pair in one forward: two rows a pair
    rows = micro_batch * (2 if cfg.train.objective == "dpo" else 1)
    if grad_accum is None:
        grad_accum = accumulation(cfg, micro_batch, block_size, world_size // tp)
    # under CUDA graphs the gradients stay allocated between steps (their addresses are the graph's)
    keep_grads = bool(getattr(getattr(model, "built", None), "keep_grads", False))
    try:
        return estimate(
            model.family.name,
            "debug",
            asdict(model.args),
            batch_size=rows,
            block_size=block_size,
            activation_checkpointing=checkpointing.resolve(cfg.perf.activation_checkpointing, cfg.lora)[0],
            # the loss the run computes (--perf.loss plain on a GPU holds the whole batch's logits), at its chunk
            loss="plain" if loss_rule(cfg.perf.loss, env.device) == "plain" else "chunked",
            loss_chunk=cfg.perf.loss_chunk,
            gpu=env.hw.name if env.device.type == "cuda" else "H100",  # the bytes do not depend on the name
            residual_dtype="bf16"
            if env.precision == "bf16" and cfg.perf.residual_dtype != "fp32"
            else "fp32",
            num_gpus=world_size,
            strategy="fsdp" if env.dist.strategy == "fsdp" else "ddp",
            optimizer=cfg.train.optimizer,
            optimizer_states=cfg.train.optimizer_states,
            cpu_offload=env.dist.cpu_offload,
            reshard_after_forward=env.dist.reshard_after_forward,
            tp=tp,
            accum_unsharded_grads=_accumulates_unsharded(env, grad_accum),
            grad_accum=grad_accum,
            keep_grads=keep_grads,
            muon_graph=records_muon_step(cfg, env, keep_grads),
            fp8=torchao_fp8(model),
        )
    except Exception:  # noqa: BLE001 - an estimate must never stop a run
        return None


def torchao_fp8(model: Any) -> bool:
    """Whether the blocks' linears are (or, in a dry run, will be) torchao's float8 ones, the fp8 the estimate
    models: ``model.transforms`` holds ``perf.fp8`` resolved; the fused recipe is our own code."""
    t = getattr(model, "transforms", None)
    return bool(getattr(t, "fp8", False)) and t.perf.fp8_recipe != "fused_rowwise"


def accumulation(cfg: Any, micro_batch: int, block_size: int, data_ranks: int) -> int:
    """The accumulation a run will have at ``micro_batch`` before its batch is planned: the config's, or with
    ``batch_size = auto`` what reaching ``train.global_batch_tokens`` takes (as ``plan_batches`` sets it)."""
    from gptoughts.perf.autobatch import accumulation_for

    t = cfg.train
    if isinstance(t.batch_size, int) or not t.global_batch_tokens or cfg.is_given("train.grad_accum"):
        return t.grad_accum
    return accumulation_for(t.global_batch_tokens, micro_batch, block_size, max(1, data_ranks))


def _accumulates_unsharded(env: Any, grad_accum: int) -> bool:
    """FSDP2 keeps the unsharded gradient between micro-batches: accumulation without a sync per micro-batch
    (``grad_accum``: the step's, as planned, e.g. raised by a resume on fewer ranks)."""
    return env.dist.strategy == "fsdp" and not env.dist.sync_every_microbatch and grad_accum > 1


def device_memory_gib(env: Any) -> float | None:
    """What a run's process may fill: the GPU's memory (or its ``perf.gpu_memory_gib`` cap); on a CPU its share of
    the memory available now (``MemAvailable`` within the cgroup's limit, split between the processes torchrun
    started on this machine); None when unknown."""
    if env.device.type == "cpu":
        return host_memory_gib(env)
    return (env.hw.memory_bytes or 0) / 2**30 or None


def host_memory_gib(env: Any) -> float | None:
    """This process's share of the host memory available now (``MemAvailable`` within the cgroup's limit, split
    between the processes torchrun started on this machine); None when unknown."""
    import os

    from gptoughts.training.checkpoint import staging

    free = staging.host_memory_available()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if env.dist.enabled else 1
    return free / max(1, local) / 2**30 if free else None


def layout_search(cfg: Any, env: Any, model: Any) -> LayoutSearch | None:
    """What the memory layout is chosen from (``perf/layout.py``) for this run on this GPU: its settings now, those
    the user set, the GPU's memory (or ``perf.gpu_memory_gib``) and the host's, and :func:`estimate_peak` of each
    layout at the micro-batch given (auto: its smallest, 1). None off CUDA (the cap is a GPU's; a CPU run is bounded
    by the host's available memory, :func:`memory_refusal`) or without a memory figure."""
    import importlib.util

    from gptoughts.perf import checkpointing

    gpu = device_memory_gib(env)
    if env.device.type != "cuda" or not gpu:
        return None
    t = cfg.train
    micro = t.batch_size if isinstance(t.batch_size, int) else 1
    start = Layout(
        checkpointing.resolve(cfg.perf.activation_checkpointing, cfg.lora)[0],
        t.optimizer_states,
        env.dist.cpu_offload,
    )
    # background checkpoints keep a host copy of the states (checkpoint_staging_gib): host memory too
    staged = cfg.checkpoint.checkpoints and cfg.checkpoint.async_save

    def measure(layout: Layout) -> Need | None:
        dist = replace(env.dist, strategy="fsdp", cpu_offload=True) if layout.cpu_offload else env.dist
        e = estimate_peak(
            layout.apply(cfg, start),
            replace(env, dist=dist),
            model,
            micro,
            t.block_size,
            dist.world_size,
            dist.tp,
        )
        if e is None:
            return None
        staging = e.checkpoint_staging_gib if staged else 0.0
        return Need(e.total_gib, e.host_gib + staging, staging)

    capped = cfg.perf.gpu_memory_gib is not None
    return LayoutSearch(
        start=start,
        measure=measure,
        gpu_gib=gpu,
        host_gib=host_memory_gib(env),
        what=f"{model.family.name}/{cfg.model.size}"
        if cfg.model.init_from is None
        else str(cfg.model.init_from),
        where=f"the {gib_figure(gpu)} of --gpu_memory_gib" if capped else f"this GPU's {gib_figure(gpu)}",
        shape=f"micro-batch {micro} x {t.block_size:,} tokens",
        fixed=fixed_layout(cfg, env.dist),
        eight_bit=importlib.util.find_spec("torchao") is not None
        and t.optimizer == "adamw"
        and not env.dist.sharded
        and env.dist.pp == 1,
    )


# The ways out of a GPU's memory (the layout chooser tries the first three itself: perf/layout.py).
GPU_FIXES = (
    "use --activation_checkpointing selective|full, --train.optimizer_states bf16, --parallel.cpu_offload true, a "
    "lower --batch_size or --block_size, or several GPUs (FSDP)"
)


def estimate_speed(
    env: Any, model: Any, block_size: int, micro_batch: int, world_size: int
) -> tuple[float | None, str]:
    """Tokens/s: on a GPU from its peak and the MFU ``bench`` measured for the size class; on a CPU from a short
    matmul timed at the threads torch has now (the plan comes before the thread count is measured)."""
    flops = model.raw.flops_per_token(block_size)
    if env.device.type == "cuda":
        peak = env.hw.peak_bf16_flops
        if not peak:
            return None, "unknown GPU peak"
        from gptoughts.perf.estimate import MIN_STEP_S, default_mfu, fp8_speedup, gpu_tokens_per_s

        d_model = getattr(model.args, "d_model", 0)
        mfu = default_mfu(d_model)
        gain = fp8_speedup(d_model) if torchao_fp8(model) else 1.0
        tps, flops_tps = gpu_tokens_per_s(
            peak, flops, mfu * gain, world_size, micro_batch * block_size, world_size
        )
        if tps < flops_tps:  # a model this small is bound by its kernel launches, not its FLOPs
            return (
                tps,
                f"at most: a step takes at least ~{MIN_STEP_S * 1e3:g} ms on a GPU, whatever its FLOPs",
            )
        fp8 = f", x {gain:g} for fp8" if gain != 1.0 else ""
        return tps, f"estimated at MFU {mfu:.2f} of {env.hw.name}'s peak{fp8}"
    # a whole training step reaches ~25% of a 512² matmul's speed (docs/performance.md, "Memory and time estimate")
    flops_s = _cpu_matmul_flops()
    return flops_s * 0.25 / flops, "from this CPU's measured matmul speed, at 25% of it"


def cpu_optimizer_seconds(cfg: Any, model: Any) -> float:
    """Seconds one optimizer step adds to a CPU step's forward+backward: Muon's Newton-Schulz matmuls, in bf16 as
    torch.optim.Muon's (~3x slower than fp32 on a CPU without bf16 instructions), at this CPU's measured bf16 matmul
    speed; 0 for AdamW (a few % of a step)."""
    import torch

    from gptoughts.perf.estimate import newton_schulz_flops

    if cfg.train.optimizer != "muon" or cfg.lora.enabled:  # LoRA adapters train with AdamW
        return 0.0
    return newton_schulz_flops(model.raw) / _cpu_matmul_flops(torch.bfloat16)


def with_optimizer_step(tokens_per_s: float, tokens_per_step: int, optimizer_s: float) -> float:
    """A forward+backward speed slowed by an optimizer step of ``optimizer_s`` seconds every ``tokens_per_step``."""
    if not optimizer_s:
        return tokens_per_s
    return tokens_per_step / (tokens_per_step / tokens_per_s + optimizer_s)


def _cpu_matmul_flops(dtype: Any = None) -> float:
    import time

    import torch

    a, b = torch.randn(512, 512, dtype=dtype), torch.randn(512, 512, dtype=dtype)
    a @ b
    # the fastest of three rounds: one round's figure is at the mercy of a shared machine's other load
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(4):
            a @ b
        best = min(best, time.perf_counter() - t)
    return 4 * 2 * 512**3 / max(best, 1e-6)
