"""AdamW or Muon with the usual parameter groups, and learning-rate schedules as pure functions of the step.

The schedule has no state of its own: the learning rate of step ``s`` is ``lr_at(s)``, so resuming only needs
the step counter (exact resume for free).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gptoughts.errors import ConfigError, UserError
from gptoughts.models import hidden_matrices
from gptoughts.training.newton_schulz import (
    apply_update,
    bucket_step,
    can_distribute,
    compiled,
    distributed_orthogonalize,
    gather_orthogonalize,
    local,
    lr_adjustment,
    momentum,
    oriented,
    orthogonalize,
    warm_all_to_all,
)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay only matrices of linear layers: never norms, biases or embeddings."""
    decay, no_decay = [], []
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for _name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or id(p) in embedding_params:
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [
        {"params": part, "weight_decay": wd}
        for params, wd in ((decay, weight_decay), (no_decay, 0.0))
        for part in by_layout(params)
    ]
    return [g for g in groups if g["params"]]


def _layout(t: torch.Tensor) -> object:
    return getattr(t, "device_mesh", None)


def by_layout(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` split by device mesh (plain tensors together), in first-seen order. Under tensor parallelism
    a model mixes plain parameters (replicated: embeddings, head) and DTensors of one or two meshes (the blocks',
    on the tp or (dp, tp) mesh), and foreach kernels refuse lists that mix them; with one layout (one process,
    DDP, FSDP) this is ``[tensors]``."""
    parts: dict[object, list[torch.Tensor]] = {}
    for t in tensors:
        parts.setdefault(_layout(t), []).append(t)
    return list(parts.values()) or [[]]


def muon_graph_rule(
    perf: Any, model_graphs: bool, dist: Any, device_type: str | None, states: str = "fp32"
) -> bool:
    """Whether Muon's step replays as one CUDA graph (``perf.muon_graph``), as :meth:`Muon._graphable` will find:
    where the model's steps are CUDA graphs (``model_graphs``: their gradients are kept in place, where a recorded
    step reads them), every parameter is a whole CUDA tensor, and AdamW's groups step fused with fp32 moments
    (``states``: train.optimizer_states). Asked where it cannot run: a ConfigError."""
    if perf.muon_graph is False:
        return False
    whole = device_type == "cuda" and not dist.sharded and not dist.cpu_offload and dist.pp == 1
    fused = perf.fused_adamw is True or (perf.fused_adamw == "auto" and device_type == "cuda")
    runs = model_graphs and whole and fused and states == "fp32"
    if perf.muon_graph is True and not runs:
        raise ConfigError(
            "perf.muon_graph needs the model's steps as CUDA graphs (--compile true --perf.cuda_graphs true), "
            "whole parameters on one GPU per process (no FSDP, tensor or pipeline parallelism, no offload) and "
            "fused AdamW with fp32 moments; leave it auto"
        )
    return runs


def records_muon_step(cfg: Any, env: Any, keep_grads: bool) -> bool:
    """Whether this run's optimizer is Muon with its step recorded as one CUDA graph (:func:`muon_graph_rule`):
    what the optimizer, the memory estimate and the batch probe all ask."""
    t = cfg.train
    return t.optimizer == "muon" and muon_graph_rule(
        cfg.perf, keep_grads, env.dist, env.device.type, t.optimizer_states
    )


def build_muon(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    fused: bool,
    muon_lr: float | None = None,
    muon_weight_decay: float | None = None,
    momentum: float = 0.95,
    compile: bool = False,
    distribute: bool = False,
    graph: bool = False,
) -> Muon:
    """Muon for the hidden matrices, AdamW (the same groups as :func:`build_adamw`) for everything else.
    ``compile``: each bucket's step one compiled graph on CUDA (perf.muon_compile); ``distribute``: sharded
    buckets' Newton-Schulz spread over the ranks (perf.muon_distribute); ``graph``: the whole step replayed as one
    CUDA graph where every parameter is a whole CUDA tensor (perf.muon_graph)."""
    hidden = hidden_matrices(model)
    groups = [
        {**g, "params": [p for p in g["params"] if id(p) not in hidden], "muon": False}
        for g in param_groups(model, weight_decay)
    ]
    muon_group = {
        "params": [p for p in model.parameters() if id(p) in hidden],
        "muon": True,
        "weight_decay": weight_decay if muon_weight_decay is None else muon_weight_decay,
        "lr_ratio": 1.0 if muon_lr is None else muon_lr / lr,
    }
    groups = [g for g in [muon_group, *groups] if g["params"]]
    for g in groups:
        g["lr"] = lr * g.get("lr_ratio", 1.0)
    muon = Muon(groups, lr=lr, betas=betas, eps=eps, momentum=momentum, fused=fused)
    muon.compile = "cuda" if compile else "off"
    muon.distribute = distribute
    muon.graph = graph
    meshes = {id(p.device_mesh): p.device_mesh for p in muon_group["params"] if muon._distributes(p)}
    for mesh in meshes.values():
        warm_all_to_all(mesh)
    return muon


@dataclass
class _StepGraph:
    """A recorded optimizer step and the tensors it reads (:meth:`Muon._graphed_step`)."""

    key: tuple
    scalars: dict[tuple, torch.Tensor]
    """The learning-rate values the step reads (:meth:`Muon._scalars`), filled before each replay."""
    grad_scale: torch.Tensor | None
    found_inf: torch.Tensor | None
    warm: int = 0
    graph: torch.cuda.CUDAGraph | None = None


class Muon(torch.optim.Optimizer):
    """Muon (momentum, then the update orthogonalized by a Newton-Schulz iteration) for the groups marked
    ``muon``, AdamW for the others, as one optimizer: one state dict, one ``step``, one set of groups for the
    schedule, checkpoints and FSDP's state-dict helpers.

    The Muon update is ``torch.optim.Muon``'s, step for step (same coefficients, nesterov momentum, bf16
    iteration, decoupled weight decay; ``adjust_lr = "match_rms_adamw"`` by default, Moonshot's 0.2·√max(A, B)
    scaling, so AdamW's learning rate and weight decay carry over), and tests/training/test_muon.py checks it
    against ``torch.optim.Muon``. We do not call that class because it refuses what we need: parameters of
    more than two dimensions (MoE experts are stacked ``[E, out, in]``: each expert is orthogonalized alone,
    as a batch), sharded parameters (under FSDP2 the update of a DTensor is computed on the whole matrix,
    gathered once per parameter, and each rank keeps its own shard; or each rank orthogonalizes its share of a
    bucket of same-shape matrices: newton_schulz.py), and skipping a non-finite step on the
    device: like the fused AdamW, ``step`` reads ``self.grad_scale`` (gradient clipping folded in) and
    ``self.found_inf`` (a device flag; 1 leaves parameters and state untouched) without a host sync.
    The AdamW groups go through ``torch.optim.adamw.adamw`` (fused on CUDA).
    """

    def __init__(
        self,
        params: list[dict],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
        adjust_lr: str = "match_rms_adamw",
        fused: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr, weight_decay=0.0, betas=betas, eps=eps, momentum=momentum, nesterov=nesterov,
            ns_steps=ns_steps, ns_coefficients=ns_coefficients, adjust_lr=adjust_lr, muon=False, fused=fused,
        )  # fmt: skip
        super().__init__(params, defaults)
        self.grad_scale: torch.Tensor | None = None
        self.found_inf: torch.Tensor | None = None
        # "bf16": the AdamW groups keep their moments in bf16 (:class:`AdamWBf16States`' step); an attribute, not a
        # group option, so that loading a checkpoint's groups does not change it. Muon's momentum stays fp32.
        self.adamw_states = "fp32"
        # How the Muon groups step (attributes too, set by build_muon): "off" (eager), "cuda" (each bucket one
        # compiled graph on CUDA, eager elsewhere: perf.muon_compile) or "always" (tests); and whether sharded
        # buckets spread their Newton-Schulz over the ranks (perf.muon_distribute).
        self.compile = "off"
        self.compile_backend = "inductor"
        # Whether the compiled buckets iterate Newton-Schulz in its square form (newton_schulz.orthogonalize):
        # faster on CUDA, within bf16 rounding of the eager step's torch.optim.Muon sequence.
        self.square = True
        self.distribute = False
        # The most whole fp32 matrices one rank stacks for a Newton-Schulz batch (:meth:`_chunks`): 1 GiB keeps
        # each bucket of a 1b Llama one batch, and cuts an 8b's MLP bucket into batches of 4 large matrices.
        self.chunk_bytes = 1 << 30
        # Whether the step replays as one CUDA graph (perf.muon_graph; set by build_muon): _graphed_step.
        self.graph = False
        self._graph: _StepGraph | None = None
        self._graph_ok: bool | None = None
        self._graph_misses = 0

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch.optim.Optimizer's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.graph and self._graphable():
            self._graphed_step()
        else:
            self._step_groups(None)
        self.grad_scale = self.found_inf = None
        return loss

    def _step_groups(self, scalars: dict[tuple, torch.Tensor] | None) -> None:
        """Every group's step; ``scalars``: :meth:`_scalars` as device tensors (the recorded step)."""
        for i, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            lr = group["lr"] if scalars is None else scalars[("lr", i)]
            if group["muon"]:
                self._muon_group(group, params, i, scalars)
            elif self.adamw_states == "bf16":
                adamw_bf16_states(self.state, group, params, self.grad_scale, self.found_inf)
            else:
                self._adamw_group(group, params, lr)

    def _graphable(self) -> bool:
        """Whether the step can be one CUDA graph: every parameter a whole CUDA tensor, AdamW's groups fused
        with fp32 moments (kernels that read the learning rate, the clipping scale and the skip flag on the
        device)."""
        if self._graph_ok is None:
            self._graph_ok = all(
                p.is_cuda and not hasattr(p, "device_mesh") for g in self.param_groups for p in g["params"]
            ) and all(g["muon"] or (g["fused"] and self.adamw_states == "fp32") for g in self.param_groups)
        return self._graph_ok

    def _graphed_step(self) -> None:
        """The step replayed as one CUDA graph (perf.muon_graph): Muon's buckets are many small kernels, whose
        launches cost more than their GPU work at small sizes. The learning rates, clipping scale and skip flag
        are copied into the graph's own tensors first. A graph is recorded after two steps run on those tensors
        (the states exist, the compiled buckets are built), and recorded again when a gradient or parameter moves
        to new memory; gradients freed every step (no ``keep_grads``) turn it off after a few tries."""
        ptrs = tuple(
            t.data_ptr() for g in self.param_groups for p in g["params"] for t in (p, p.grad) if t is not None
        )
        key = (self.grad_scale is None, self.found_inf is None, ptrs)
        g = self._graph
        if g is None or g.key != key:
            if g is not None:
                self._graph_misses += 1
                if self._graph_misses > 3:
                    self.graph, self._graph = False, None
                    self._step_groups(None)
                    return
            device = self.param_groups[0]["params"][0].device
            g = self._graph = _StepGraph(
                key,
                {k: torch.zeros((), device=device) for k in self._scalars()},
                None if self.grad_scale is None else torch.empty_like(self.grad_scale),
                None if self.found_inf is None else torch.empty_like(self.found_inf),
            )
        for k, value in self._scalars().items():
            g.scalars[k].fill_(value)
        if g.grad_scale is not None:
            g.grad_scale.copy_(self.grad_scale)
        if g.found_inf is not None:
            g.found_inf.copy_(self.found_inf)
        self.grad_scale, self.found_inf = g.grad_scale, g.found_inf
        if g.warm < 2:
            self._step_groups(g.scalars)
            g.warm += 1
            return
        if g.graph is None:
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: the checkpoint stager and the loader's pinning threads make CUDA calls meanwhile
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    self._step_groups(g.scalars)
            except BaseException:
                self._graph = None  # a capture cut short (out of memory) must never be replayed
                raise
            g.graph = graph
        g.graph.replay()

    def _scalars(self) -> dict[tuple, float]:
        """The learning-rate values of this step, computed as the step launched kernel by kernel computes them
        (the same float32 values): each group's rate; for a Muon group also rate x weight decay, and rate x each
        of its matrices' adjustments (:func:`lr_adjustment`)."""
        out: dict[tuple, float] = {}
        for i, group in enumerate(self.param_groups):
            lr = out[("lr", i)] = group["lr"]
            if group["muon"]:
                out[("lr_wd", i)] = lr * group["weight_decay"]
                for shape in {p.shape for p in group["params"]}:
                    adjust = lr_adjustment(group["adjust_lr"], shape)
                    out[("scale", i, adjust)] = lr * adjust
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._graph, self._graph_ok = None, None  # the graph read the old state tensors; groups may differ
        if self.adamw_states == "bf16":
            _moments_to_bf16(self, [g for g in self.param_groups if not g["muon"]])

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._graph, self._graph_ok = None, None

    def _adamw_group(self, group: dict, params: list[torch.Tensor], lr: float | torch.Tensor) -> None:
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros(
                    (), dtype=torch.float32, device=p.device if group["fused"] else "cpu"
                )
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        grads = [p.grad for p in params]
        fused = group["fused"]
        if not fused and self.grad_scale is not None:  # the fused kernel divides as it reads; here, a pass
            grads = torch._foreach_div(grads, self.grad_scale)
        if not fused and self.found_inf is not None:
            raise RuntimeError(
                "found_inf needs the fused AdamW (clip_and_step checks it on the host otherwise)"
            )
        beta1, beta2 = group["betas"]
        from torch.optim.adamw import adamw

        adamw(
            params, grads, exp_avgs, exp_avg_sqs, [], steps,
            foreach=not fused, fused=fused, grad_scale=self.grad_scale if fused else None,
            found_inf=self.found_inf if fused else None, amsgrad=False, beta1=beta1, beta2=beta2,
            lr=lr, weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
        )  # fmt: skip

    def _muon_group(
        self, group: dict, params: list[torch.Tensor], index: int, scalars: dict[tuple, torch.Tensor] | None
    ) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        common = dict(
            mu=group["momentum"], nesterov=group["nesterov"], grad_scale=self.grad_scale,
            keep=None if self.found_inf is None else 1.0 - self.found_inf,  # 0 on a non-finite step
            coefficients=group["ns_coefficients"], steps=group["ns_steps"],
        )  # fmt: skip
        # Buckets of whole matrices of one shape as iterated (w1 [f, d] beside w2 [d, f]) and one learning-rate
        # adjustment go through Newton-Schulz together (measured on an H100, 125m b32 s1024: Muon's step cost 46 ms
        # more than AdamW's one matrix at a time, 9 ms batched). Sharded matrices are gathered one by one, unless
        # their work is spread over the ranks (perf.muon_distribute).
        buckets: dict[tuple, list[torch.Tensor]] = {}
        for i, p in enumerate(params):
            if not hasattr(p, "device_mesh"):
                key = (oriented(p.shape), lr_adjustment(group["adjust_lr"], p.shape), p.dtype, p.device)
            elif self._distributes(p):
                key = (tuple(p.shape), p.dtype, p.device, p.device_mesh, tuple(p.placements))
            else:
                key = ("sharded", i)
            buckets.setdefault(key, []).append(p)
        for bucket in (c for b in buckets.values() for c in self._chunks(b)):
            adjust = lr_adjustment(group["adjust_lr"], bucket[0].shape)
            lr_wd, scale = (
                (lr * wd, lr * adjust)
                if scalars is None
                else (scalars[("lr_wd", index)], scalars[("scale", index, adjust)])
            )
            # Element-wise work on each rank's shard (the whole tensor when not sharded); in-place on a DTensor's
            # local tensor updates the DTensor.
            weights = [local(p) for p in bucket]
            grads = [local(p.grad) for p in bucket]
            bufs = [local(self.state[p]["momentum_buffer"]) for p in bucket]
            compile_it = self.compile == "always" or (self.compile == "cuda" and weights[0].is_cuda)
            if hasattr(bucket[0], "device_mesh"):
                self._sharded_bucket(bucket, weights, grads, bufs, lr_wd, scale, compile_it, common)
            elif compile_it:
                # The learning rate as device tensors: a new rate each step is no new graph, and no host sync.
                if scalars is None:
                    on = weights[0].device
                    lr_wd, scale = torch.full((), lr_wd, device=on), torch.full((), scale, device=on)
                compiled(bucket_step, self.compile_backend)(
                    weights, grads, bufs, lr_wd=lr_wd, scale=scale, square=self.square, **common
                )
            else:
                bucket_step(weights, grads, bufs, lr_wd=lr_wd, scale=scale, **common)

    def _distributes(self, p: torch.Tensor) -> bool:
        return self.distribute and can_distribute(p)

    def _chunks(self, bucket: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """``bucket`` cut so that no rank stacks more than ``self.chunk_bytes`` of whole fp32 matrices at once:
        Newton-Schulz's working set is a few times its stacked input, and a bucket of MoE experts (every layer's
        ``[E, d, f]``) stacked whole is several GiB beside the weights, gradients and momentum. Each matrix is
        orthogonalized alone, so the cut changes no result; under ``distribute`` a chunk keeps a multiple of the
        rank count, each rank still taking its share."""
        p = bucket[0]
        ranks = p.device_mesh.size() if self._distributes(p) else 1
        whole = 4 * p.numel() if ranks > 1 else 4 * local(p).numel()
        size = ranks * max(1, self.chunk_bytes // max(1, whole))
        return [bucket[i : i + size] for i in range(0, len(bucket), size)]

    def _sharded_bucket(
        self,
        bucket: list[torch.Tensor],
        weights: list[torch.Tensor],
        grads: list[torch.Tensor],
        bufs: list[torch.Tensor],
        lr_wd: float,
        scale: float,
        compile_it: bool,
        common: dict,
    ) -> None:
        coefficients, steps, keep = common["coefficients"], common["steps"], common["keep"]
        names = ("mu", "nesterov", "grad_scale", "keep")
        updates = momentum(grads, bufs, **{k: common[k] for k in names})
        ns = compiled(orthogonalize, self.compile_backend) if compile_it else orthogonalize
        if self._distributes(bucket[0]):
            ortho = distributed_orthogonalize(updates, bucket[0], coefficients, steps, ns)
        else:
            ortho = [gather_orthogonalize(u, p, coefficients, steps, ns) for u, p in zip(updates, bucket)]
        apply_update(weights, ortho, lr_wd=lr_wd, scale=scale, keep=keep)


def build_adamw(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    fused: bool,
    states: str = "fp32",
) -> torch.optim.Optimizer:
    """AdamW over :func:`param_groups`, its moments stored as ``states`` says (:func:`with_states`)."""
    # The fused CUDA kernel updates all parameters in a few launches instead of one chain of kernels per tensor;
    # foreach (the default elsewhere) batches them at the Python level.
    kwargs = {"fused": True} if fused else {"foreach": True}
    opt = torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, **kwargs)
    return with_states(opt, states)


TORCHAO_MISSING = "train.optimizer_states = 8bit needs torchao: pip install torchao (or use bf16 states)"

_STATES_DESCRIBED = {
    "fp32": "fp32 moments",
    "bf16": "bf16 moments, stochastic rounding",
    "8bit": "8-bit moments, torchao AdamW8bit",
}


def describe_states(states: str) -> str:
    """What the plan's optimizer line says of ``train.optimizer_states``."""
    return _STATES_DESCRIBED[states]


def with_states(optimizer: torch.optim.Optimizer, states: str) -> torch.optim.Optimizer:
    """``optimizer`` (an AdamW or a :class:`Muon` just built, no state yet) with AdamW's moments stored as
    ``states`` says: the same parameter groups, only the storage changes.

    * ``fp32``: unchanged (torch's AdamW, fused on CUDA).
    * ``bf16``: :class:`AdamWBf16States`; a Muon keeps its class and steps its AdamW groups that way.
    * ``8bit``: torchao's ``AdamW8bit`` (AdamW only). It has no device-side ``grad_scale``/``found_inf``, so
      :func:`clip_and_step` clips it with a foreach pass and checks the step on the host (one sync per step).
    """
    if states not in _STATES_DESCRIBED:
        raise ValueError(f"unknown optimizer states {states!r}")
    if states == "fp32":
        optimizer.register_load_state_dict_pre_hook(_dequantized_states)
        return optimizer
    if isinstance(optimizer, Muon):
        if states != "bf16":
            raise UserError(
                f"train.optimizer_states = {states} is AdamW's; with train.optimizer = muon use "
                "--train.optimizer_states bf16"
            )
        optimizer.adamw_states = "bf16"
        optimizer.register_load_state_dict_pre_hook(_dequantized_states)
        return optimizer
    d = optimizer.defaults
    common = dict(lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"])
    # Each group keeps its parameters and our keys (lr_ratio, its weight decay...), not torch.AdamW's own options
    # (fused, foreach, amsgrad...): the new class brings its defaults.
    torch_only = set(d) - set(common)
    groups = [{k: v for k, v in g.items() if k not in torch_only} for g in optimizer.param_groups]
    if states == "bf16":
        bf16 = AdamWBf16States(groups, **common)
        bf16.register_load_state_dict_pre_hook(_dequantized_states)
        return bf16
    try:
        from torchao.optim import AdamW8bit
    except ImportError:
        raise UserError(TORCHAO_MISSING) from None
    eight = AdamW8bit(groups, **common)
    eight.register_load_state_dict_post_hook(_quantized_states)
    return eight


# A run may resume a checkpoint written with other optimizer states (``train.optimizer_states`` is the resuming
# run's): the moments are converted as they are loaded. fp32 <-> bf16: torch's load casts them to the parameter's
# dtype and AdamWBf16States.load_state_dict back to bf16 (rounded to nearest). 8-bit moments (torchao's
# OptimState8bit, which a plain cast keeps 8-bit) are dequantized first; plain moments loaded into AdamW8bit are
# quantized, and the learning rates made tensors again (a float lr makes torchao's step raise).


def _torchao_state(t: object) -> bool:
    return isinstance(t, torch.Tensor) and type(t).__module__.startswith("torchao.")


def _dequantized_states(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """Pre-hook of ``load_state_dict``: torchao's 8-bit moments of ``state_dict`` as plain fp32 tensors."""
    if not any(_torchao_state(v) for s in state_dict.get("state", {}).values() for v in s.values()):
        return state_dict
    state = {
        k: {n: v.dequantize() if _torchao_state(v) else v for n, v in s.items()}
        for k, s in state_dict["state"].items()
    }
    return {**state_dict, "state": state}


def _quantized_states(optimizer: torch.optim.Optimizer) -> None:
    """Post-hook of torchao's AdamW8bit ``load_state_dict``: tensor learning rates, and plain moments (an fp32 or
    bf16 checkpoint's) stored as this optimizer stores new ones (8-bit where it quantizes)."""
    for g in optimizer.param_groups:
        if not isinstance(g["lr"], torch.Tensor):
            g["lr"] = torch.tensor(g["lr"], dtype=torch.float32)
        for p in g["params"]:
            s = optimizer.state.get(p, {})
            for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
                if key in s and not _torchao_state(s[key]):
                    buf = optimizer._new_buffer(p, signed)
                    buf.copy_(s[key].to(buf.device, torch.float32))
                    s[key] = buf


class AdamWBf16States(torch.optim.Optimizer):
    """AdamW whose two moments are stored in bf16 (4 bytes per parameter instead of 8), each step computed in fp32
    (the stored moments widened, the new ones rounded stochastically when stored); the weights stay fp32 masters.
    The same update as ``torch.optim.AdamW`` up to that rounding (tests/training/test_optim.py checks it).

    Like the fused AdamW, ``step`` reads ``self.grad_scale`` (gradient clipping folded in: each gradient is
    divided by it as it is read) and ``self.found_inf`` (a device flag; 1 leaves weights, moments and step count
    untouched) without a host sync, so ``defaults["fused"]`` is True: :func:`clip_and_step` takes its fused path.

    Why our own step and not a library's: torch's fused and foreach AdamW keep the moments in the parameters'
    dtype; torchao's ``_AdamW`` does too (its ``bf16_stochastic_round`` is for bf16 *weights*), and neither it nor
    torchao's low-bit classes read ``grad_scale``/``found_inf`` on the device (a clipping pass and a host sync
    per step). And torchao is not installed on the GPU machines. The step is one elementwise function per
    parameter, compiled on CUDA into one kernel that reads weight, gradient and moments once and writes weight
    and moments once: 20 bytes per parameter against 28 for the fused fp32 kernel.
    """

    def __init__(
        self,
        params: list[dict] | list[torch.Tensor],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True))
        self.grad_scale: torch.Tensor | None = None
        self.found_inf: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch.optim.Optimizer's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                adamw_bf16_states(self.state, group, params, self.grad_scale, self.found_inf)
        self.grad_scale = self.found_inf = None
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        # torch's load casts every floating state tensor to its parameter's dtype (fp32 here): cast the moments
        # back, or a resumed run would hold fp32 moments (the same values, twice the memory).
        super().load_state_dict(state_dict)
        _moments_to_bf16(self, self.param_groups)


def _moments_to_bf16(optimizer: torch.optim.Optimizer, groups: list[dict]) -> None:
    for g in groups:
        for p in g["params"]:
            state = optimizer.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state and state[key].dtype != torch.bfloat16:
                    state[key] = state[key].to(torch.bfloat16)


def adamw_bf16_states(
    state: dict,
    group: dict,
    params: list[torch.Tensor],
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> None:
    """One AdamW step of ``params`` (one group) with bf16 moments in ``state``: :class:`AdamWBf16States`'s and
    :class:`Muon`'s AdamW groups'. Sharded parameters (DTensors) step on their local shards (all of it is
    elementwise); the moments are shaped and sharded like their parameter, so checkpoints treat them alike."""
    beta1, beta2 = group["betas"]
    lrs: dict[torch.device, torch.Tensor] = {}
    for p in params:
        s = state[p]
        weight = local(p)
        if not s:
            # The step count on the device (as the fused AdamW keeps it): a skipped step leaves it unchanged
            # without a host sync, and the bias corrections are computed in the kernel.
            s["step"] = torch.zeros((), dtype=torch.float32, device=weight.device)
            s["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
            s["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
        if weight.device not in lrs:  # a tensor, so that a new learning rate is no new compiled graph
            lrs[weight.device] = torch.full((), group["lr"], dtype=torch.float32, device=weight.device)
        fn = _compiled_bf16_step() if weight.is_cuda else _adamw_bf16_step
        fn(
            weight, local(p.grad), local(s["exp_avg"]), local(s["exp_avg_sq"]), s["step"],
            lrs[weight.device], beta1, beta2, group["weight_decay"], group["eps"], grad_scale, found_inf,
        )  # fmt: skip


def _adamw_bf16_step(
    p: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    lr: torch.Tensor,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> None:
    """torch.optim.AdamW's update of one parameter, in fp32, from and to bf16 moments."""
    g = grad.float()
    if grad_scale is not None:
        g = g / grad_scale
    new_step = step + 1 if found_inf is None else step + (1 - found_inf)
    m = exp_avg.float().lerp(g, 1 - beta1)
    v = exp_avg_sq.float() * beta2 + (1 - beta2) * g * g
    bias1 = 1 - beta1**new_step
    bias2 = 1 - beta2**new_step
    denom = v.sqrt() / bias2.sqrt() + eps
    new_p = p * (1 - lr * weight_decay) - (lr / bias1) * m / denom
    new_m, new_v = bf16_stochastic_round(m), bf16_stochastic_round(v)
    if found_inf is not None:  # a skipped step keeps everything as it was (what the fused kernel does)
        skip = found_inf > 0
        new_p = torch.where(skip, p, new_p)
        new_m = torch.where(skip, exp_avg, new_m)
        new_v = torch.where(skip, exp_avg_sq, new_v)
    p.copy_(new_p)
    exp_avg.copy_(new_m)
    exp_avg_sq.copy_(new_v)
    step.copy_(new_step)


def bf16_stochastic_round(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) rounded to bf16 up or down at random, in proportion to its distance to each: unbiased, so
    that small increments (``(1 - beta2) * g**2`` against the second moment) are kept on average instead of being
    rounded away at each step. bf16 is fp32's upper 16 bits: add 16 random low bits, then truncate."""
    bits = x.view(torch.int32)
    noise = torch.randint_like(bits, 0, 1 << 16)
    return ((bits + noise) & -65536).view(torch.float32).bfloat16()


@functools.cache
def _compiled_bf16_step() -> Callable[..., None]:
    compiled = torch.compile(_adamw_bf16_step, fullgraph=True, dynamic=False)

    # One graph per parameter shape (a handful per model), as torchao compiles its optimizers' steps: lift dynamo's
    # recompile limit, which would otherwise fall back to eager after 8 shapes.
    unlimited = getattr(torch._dynamo.utils, "disable_cache_limit", contextlib.nullcontext)

    def step(*args: object) -> None:
        with unlimited():
            compiled(*args)

    return step


@dataclass(frozen=True)
class Schedule:
    kind: str
    peak_lr: float
    total_steps: int
    warmup_steps: int
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2

    def lr_at(self, step: int) -> float:
        """Learning rate for optimizer step ``step`` (0-based)."""
        min_lr = self.peak_lr * self.min_lr_ratio
        if self.warmup_steps > 0 and step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.peak_lr
        if self.kind == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            progress = min(1.0, (step - self.warmup_steps) / span)
            return min_lr + 0.5 * (self.peak_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
        if self.kind == "wsd":
            start = self.decay_start()
            if step < start:
                return self.peak_lr
            progress = min(1.0, (step - start) / max(1, self.total_steps - start))
            return self.peak_lr + (min_lr - self.peak_lr) * progress
        raise ValueError(f"unknown schedule {self.kind}")

    def decay_start(self) -> int:
        """wsd: the step its decay starts at, ``decay_fraction`` of the run before its end, and never before the
        warmup ends: a warmup that runs into that window shortens the decay (which still reaches the floor at the
        end, as cosine's does), rather than the rate falling from the peak in one step where the warmup ends."""
        decay_steps = max(1, int(round(self.total_steps * self.decay_fraction)))
        return max(self.warmup_steps, self.total_steps - decay_steps)


def default_warmup(total_steps: int) -> int:
    return max(1, min(2000, int(0.02 * total_steps)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the schedule's learning rate; a group with its own peak (Muon's) keeps its ratio to it."""
    for g in optimizer.param_groups:
        value = lr * g.get("lr_ratio", 1.0)
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].fill_(value)  # torchao's optimizers keep it a tensor (no recompile when it changes)
        else:
            g["lr"] = value


def zero_grads(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], *, keep: bool) -> None:
    """Clear the gradients after a step: freed, or with ``keep`` (CUDA graphs, ``setup.Built.keep_grads``)
    allocated once as zeros and zeroed in place, so that every backward adds into them and no graph's output
    buffer becomes a ``.grad``."""
    if not keep:
        optimizer.zero_grad(set_to_none=True)
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()


def clip_and_step(
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    max_norm: float,
    loss_sum: torch.Tensor,
    *,
    fused: bool,
    scaler: object | None = None,
    norm_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip the gradients to ``max_norm`` (global L2 norm) and step, skipping a non-finite step, with no host sync
    on the fused path. Returns ``(grad_norm before clipping, found_inf)`` as device tensors.

    With a fused AdamW (and no loss scaler), clipping is folded into the optimizer kernel: it divides every
    gradient by ``grad_scale = max(1, norm / max_norm)`` as it reads it, instead of a separate read-and-write
    pass over all gradients (``clip_grad_norm_``'s ``_foreach_mul_``), and it reads ``found_inf`` on the device
    to leave parameters and state untouched when the step is not finite.

    ``norm_reduce``: the global norm from this rank's (pipeline parallelism: each rank holds some stages'
    parameters), so that every stage clips, and skips a non-finite step, alike.
    """
    reduce = norm_reduce or (lambda n: n)
    if fused and scaler is None:
        grads = [p.grad for p in params if p.grad is not None]
        grad_norm = reduce(total_norm(grads))
        # Offloaded parameters step on the CPU, where the loss is not: the flag goes where the kernel runs.
        found_inf = (~torch.isfinite(grad_norm) | ~torch.isfinite(loss_sum)).float().to(grad_norm.device)
        optimizer.grad_scale = (
            ((grad_norm + 1e-6) / max_norm).clamp(min=1.0) if math.isfinite(max_norm) else None
        )
        optimizer.found_inf = found_inf
        optimizer.step()
        return grad_norm, found_inf
    if scaler is not None:
        scaler.unscale_(optimizer)  # type: ignore[attr-defined]
    grads = [p.grad for p in params if p.grad is not None]
    if norm_reduce is None and len(by_layout(grads)) == 1:
        grad_norm = _full(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True))
    else:  # several layouts (tensor parallel: DTensors beside plain tensors) or several pipeline stages
        grad_norm = reduce(total_norm(grads))
        if math.isfinite(max_norm):  # clip_grad_norm_'s rule, one foreach pass per layout
            coef = (max_norm / (grad_norm + 1e-6)).clamp(max=1.0)
            for part in by_layout(grads):
                torch._foreach_mul_(part, coef)
    found_inf = (~torch.isfinite(grad_norm) | ~torch.isfinite(loss_sum)).float()
    if scaler is not None:
        scaler.step(optimizer)  # type: ignore[attr-defined]  # skips on overflow; fused optimizers skip without a sync
        scaler.update()  # type: ignore[attr-defined]
    elif fused:
        optimizer.found_inf = found_inf
        optimizer.step()
    elif found_inf.item() == 0:  # free on CPU; a sync on CUDA only when fused AdamW is turned off
        optimizer.step()
    return grad_norm, found_inf


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of ``grads`` as a plain tensor, whatever mix of plain tensors and DTensors they are:
    one norm per layout (:func:`by_layout`; a DTensor part's norm summed over its mesh), then the norm of those.
    A replicated gradient (a plain tensor under tensor parallelism) is counted once, as it should be."""
    parts = by_layout(grads)
    if len(parts) == 1:
        return _full(torch.nn.utils.get_total_norm(grads, foreach=True))
    norms = [_full(torch.nn.utils.get_total_norm(part, foreach=True)) for part in parts]
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))


def _full(norm: torch.Tensor) -> torch.Tensor:
    """The global norm as a plain tensor: with sharded (FSDP, DTensor) gradients it is a partial DTensor, and
    ``full_tensor()`` sums the ranks' parts."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
