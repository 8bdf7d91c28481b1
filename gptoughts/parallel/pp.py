"""Pipeline parallelism (``--parallel.pp N``): the blocks split into stages by layers, micro-batches flowing
through them under a ``torch.distributed.pipelining`` schedule (1F1B, or interleaved 1F1B).

* :func:`split_layers`: ``pp`` stages (``2 x pp`` interleaved); the first also holds the embedding, the last
  the final norm and the head, which counts as one layer in the even split (``parallel.pp_layers``: by hand).
* :func:`make_stage`: the family's own module with what the stage does not hold set to None and ``layers`` a
  :class:`StageLayers` keyed by the original indices (state-dict names unchanged), sharing the tensors of the
  whole model every rank builds from the run's seed (the weights of a one-process run).
* :class:`Pipeline`: the step (the objective's own loss on the last stage, scaled to the global token mean),
  the norm over all stages, forward-only evaluation, and checkpoints gathered to rank 0 in the single-file
  format. Data parallelism across pipelines: FSDP2 per stage, or gradients averaged over ``dp`` after a step.

Covers the llama family with untied embeddings and plain batches; :func:`check_supported` refuses the rest in
one line. Sampling is skipped. Applied in ``training/setup.py`` after fp8 and before activation checkpointing,
compile and FSDP/DDP (each applied per stage). The whole design: ``docs/parallel.md``.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gptoughts.errors import ConfigError, UserError

SCHEDULES = ("1f1b", "interleaved")


class StageLayers(nn.ModuleDict):
    """The blocks a stage holds, keyed by their index in the whole model (state-dict names stay ``layers.N``),
    iterated in order as values, like the ``nn.ModuleList`` they replace (``for layer in self.layers``)."""

    def __iter__(self):  # type: ignore[override]
        return iter(self._modules.values())


def stages_of(pp: int, schedule: str) -> int:
    """Number of stages: one per pipeline rank, two with the interleaved schedule."""
    return pp * (2 if schedule == "interleaved" else 1)


def split_layers(n_layers: int, n_stages: int, override: list[int] | None = None) -> list[range]:
    """The layers of each stage: ``override`` (``parallel.pp_layers``), else ``n_layers + 1`` units spread as
    evenly as they go, the extra ones to the later stages, the head being the last stage's extra unit (16
    layers on 2 stages: 0-7 | 8-15 + head; 22 on 4: 5 | 6 | 6 | 5 + head)."""
    if override:
        if len(override) != n_stages:
            raise ConfigError(
                f"parallel.pp_layers has {len(override)} entries for {n_stages} pipeline stages"
            )
        if any(c < 1 for c in override) or sum(override) != n_layers:
            raise ConfigError(
                f"parallel.pp_layers = {list(override)} must be {n_stages} counts >= 1 summing to the "
                f"model's {n_layers} layers"
            )
        counts = list(override)
    else:
        if n_layers < n_stages:
            raise ConfigError(
                f"the model's {n_layers} layers cannot fill {n_stages} pipeline stages; lower --parallel.pp"
            )
        units, extra = divmod(n_layers + 1, n_stages)
        counts = [units + (i >= n_stages - extra) for i in range(n_stages)]
        counts[-1] -= 1  # the head's unit
        if min(counts) < 1:  # fewer layers than units to spare: plain even split
            units, extra = divmod(n_layers, n_stages)
            counts = [units + (i >= n_stages - extra) for i in range(n_stages)]
    starts = [0, *itertools.accumulate(counts)]
    return [range(a, b) for a, b in zip(starts, starts[1:])]


def describe(split: list[range], pp: int, schedule: str, microbatches: int) -> str:
    """The run plan's line: ``2 stages x 1f1b, 8 micro-batches, layers 0-7 | 8-15 + head``."""
    parts = [f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start) for r in split]
    ranks = f"{pp} ranks x 2 stages" if schedule == "interleaved" else f"{pp} stages"
    return (
        f"{ranks} x {schedule}, {microbatches} micro-batches per step, layers {' | '.join(parts)} + head; "
        "no sampling during training (generation is not pipelined)"
    )


def microbatches(rows: int, pp: int, schedule: str, asked: int) -> int:
    """Micro-batches of one pipeline step over ``rows`` rows: ``asked``, else the most that divide ``rows``
    up to ``2 x pp`` (fewer leave the stages idle longer: the bubble is ``(pp - 1) / (n + pp - 1)``). Both
    schedules need ``n >= pp`` (1F1B) and a multiple of ``pp`` (interleaved rounds)."""
    need = "a multiple of parallel.pp" if schedule == "interleaved" else "at least parallel.pp"

    def ok(n: int) -> bool:
        return rows % n == 0 and n >= pp and (schedule != "interleaved" or n % pp == 0)

    if asked:
        if not ok(asked):
            raise ConfigError(
                f"parallel.pp_microbatches = {asked} must divide the step's {rows} rows (batch_size x "
                f"grad_accum) and be {need} ({pp})"
            )
        return asked
    for n in range(min(rows, max(2 * pp, 1)), 0, -1):
        if ok(n):
            return n
    raise ConfigError(
        f"a pipeline of {pp} stages needs at least {pp} rows per step (micro-batches), the step has {rows}: "
        f"raise --batch_size or --grad_accum to a multiple of {pp}"
    )


def check_supported(family: str, args: Any, *, lora: bool, generic: bool, objective: str) -> None:
    """Refuse, in one line, what the stage split does not cover (why each: ``docs/parallel.md``)."""
    if lora:
        raise ConfigError("parallel.pp does not cover LoRA fine-tuning yet; drop --parallel.pp")
    if generic:
        raise ConfigError(
            "parallel.pp covers the native families; this model runs on the generic transformers path"
        )
    if objective != "causal":
        raise ConfigError(f"parallel.pp covers causal LMs; {family} trains with the {objective} objective")
    if family != "llama":
        raise ConfigError(
            f"parallel.pp covers the llama family (untied embeddings); {family} is not split into stages yet"
        )
    if getattr(args, "tie_embeddings", False):
        raise ConfigError(
            "parallel.pp needs an untied LM head (the tied matrix would live on the first and last stage): "
            "add --model.tie_embeddings false"
        )


def _child_name(model: nn.Module, module: nn.Module | None) -> str | None:
    return next((n for n, m in model.named_children() if m is module), None) if module is not None else None


def make_stage(model: nn.Module, layers: range, *, first: bool, last: bool) -> nn.Module:
    """The part of ``model`` one stage runs: its own module tree sharing ``model``'s tensors, holding the
    blocks ``layers``, the token embedding when ``first`` and the final norm and head when ``last``. The last
    stage returns the final normed hidden state (the objective applies the head in its loss)."""
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    stage = copy.deepcopy(model, memo=shared)  # new modules, the same parameter and buffer tensors
    blocks = list(stage.layers)
    stage.layers = StageLayers({str(i): blocks[i] for i in layers})
    if not first:
        setattr(stage, _child_name(stage, stage.token_embedding), None)
    if not last:
        setattr(stage, _child_name(stage, stage.final_norm), None)
        stage.output = None
    else:
        stage.register_forward_pre_hook(_return_hidden, with_kwargs=True)
    return stage


def _return_hidden(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return args, {**kwargs, "return_hidden": True}


class RankModel(nn.Module):
    """The stages one rank holds, seen as one module with the whole model's names (``tok_embeddings``,
    ``layers.N``, ``norm``, ``output``: the modules themselves, shared with the stages): what the optimizer,
    clipping and checkpoints work on."""

    def __init__(self, stages: list[nn.Module]) -> None:
        super().__init__()
        self._stages = stages  # a plain list: not children (their modules are registered below)
        layers = {}
        for stage in stages:
            for name, child in stage.named_children():
                if child is None:
                    continue
                if name == "layers":
                    layers.update(child.named_children())
                elif isinstance(child, nn.Module) and any(True for _ in child.parameters()):
                    setattr(self, name, child)
        self.layers = StageLayers(dict(sorted(layers.items(), key=lambda kv: int(kv[0]))))

    @property
    def output_weight(self) -> torch.Tensor | None:
        """The LM head's weight on the rank holding the last stage (None elsewhere): the model protocol's name,
        which ``models.hidden_matrices`` reads so that Muon leaves the head to AdamW as on one process."""
        output = getattr(self, "output", None)
        return output.weight if output is not None else None

    def train(self, mode: bool = True) -> RankModel:
        for stage in self._stages:
            stage.train(mode)
        return super().train(mode)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise UserError("a pipeline-parallel model runs through its schedule (Pipeline.step), not forward()")


class Pipeline:
    """The rank's stages under a schedule: :meth:`step` (forward and backward of an optimizer step's rows),
    :meth:`eval_loss`, :meth:`global_norm`, and the gathered state dicts of checkpoints."""

    def __init__(
        self,
        stages: list[nn.Module],
        stage_ids: list[int],
        n_stages: int,
        *,
        info: Any,
        device: torch.device,
        schedule: str,
        hidden_loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
        hidden_dim: int,
        hidden_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.modules = stages  # wrapped (DDP / FSDP) or plain
        self.stage_ids = stage_ids
        self.n_stages = n_stages
        self.info = info
        self.device = device
        self.schedule_name = schedule
        self.hidden_loss = hidden_loss
        self.hidden_dim = hidden_dim
        self.hidden_dtype = hidden_dtype
        self.group = info.mesh["pp"].get_group()
        self.pp, self.pp_rank = info.pp, info.pp_rank
        self.first = 0 in stage_ids
        self.last = n_stages - 1 in stage_ids
        self.view = RankModel([_unwrap(m) for m in stages])
        self.param_order: list[str] = []
        """The parameter names in the order a one-process run's optimizer holds them: reads its checkpoints,
        whose optimizer state is keyed by index (set by the assembly)."""
        self.n_micro = 0
        """Micro-batches of one step (:func:`microbatches`, set once the batch plan is known)."""
        self._schedules: dict[int, Any] = {}
        self._scale: torch.Tensor | None = None
        self._loss_sums: list[torch.Tensor] = []

    # ---------------------------------------------------------------------------------------------- train
    def _schedule(self, n_micro: int) -> Any:
        if n_micro not in self._schedules:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

            stages = [
                PipelineStage(m, s, self.n_stages, self.device, group=self.group)
                for m, s in zip(self.modules, self.stage_ids)
            ]
            if self.schedule_name == "interleaved":
                sched = ScheduleInterleaved1F1B(stages, n_micro, loss_fn=self._loss, scale_grads=False)
            else:
                sched = Schedule1F1B(stages[0], n_micro, loss_fn=self._loss, scale_grads=False)
            self._schedules[n_micro] = sched
        return self._schedules[n_micro]

    def _loss(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        ls = self.hidden_loss(_unwrap(self.modules[-1]), hidden, target)
        self._loss_sums.append(ls.detach().float())
        assert self._scale is not None
        return ls * self._scale

    def step(self, batch: tuple[torch.Tensor, ...], scale: torch.Tensor) -> torch.Tensor:
        """Forward and backward of ``batch`` (``(x, y)``, all the step's rows) in ``n_micro`` micro-batches, each
        micro-batch's summed token loss multiplied by ``scale``. Returns the unscaled loss sum of this rank's
        rows (0 on ranks without the last stage)."""
        if len(batch) > 2:
            raise UserError("parallel.pp takes plain (x, y) batches; packed rows are not pipelined")
        self._scale, self._loss_sums = scale, []
        x, y = batch[0], batch[1]
        kwargs: dict[str, Any] = {"target": y, "losses": []} if self.last else {}
        self._schedule(self.n_micro).step(*((x,) if self.first else ()), **kwargs)
        self._scale = None
        if self.info.dp_size > 1 and not self.info.sharded:
            self._average_grads()
        if not self.last:
            return torch.zeros((), device=self.device)
        # The schedule calls the loss once per micro-batch; newer torch also once before, on the shape-inference
        # pass of the first step (on placeholder data): only the last n_micro calls are the step's.
        return torch.stack(self._loss_sums[-self.n_micro :]).sum()

    def _average_grads(self) -> None:
        """DDP's part under a pipeline (``dist.wrap`` leaves stages unwrapped): average the gradients over the
        data-parallel group, one flat all-reduce per dtype after the step (no overlap with the backward, unlike
        DDP's buckets: for speed at scale, FSDP (``--parallel.strategy fsdp``) is the pipeline's partner)."""
        grads = [p.grad for p in self.view.parameters() if p.grad is not None]
        for dtype in {g.dtype for g in grads}:
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            dist.all_reduce(flat, group=self.info.dp_group)
            flat /= self.info.dp_size
            for g, part in zip(same, flat.split([g.numel() for g in same])):
                g.copy_(part.view_as(g))

    def global_norm(self, local: torch.Tensor) -> torch.Tensor:
        """The L2 norm over all stages from this rank's (already global over data-parallel shards)."""
        sq = local.float().square()
        dist.all_reduce(sq, group=self.group)
        return sq.sqrt()

    # ----------------------------------------------------------------------------------------------- eval
    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage % self.pp)

    @torch.no_grad()
    def eval_loss(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward only through every stage: ``(loss_sum, n_tokens)`` on the last stage's rank, zeros elsewhere.
        Consecutive stages always sit on different ranks, so each hop is one blocking send/receive."""
        x, y = batch[0], batch[1]
        zero = torch.zeros((), device=self.device)
        out = (zero, zero)
        shape = (*x.shape, self.hidden_dim)
        for module, s in zip(self.modules, self.stage_ids):
            if s == 0:
                h = module(x)
            else:
                h = torch.empty(shape, dtype=self.hidden_dtype, device=self.device)
                dist.recv(h, src=self._peer(s - 1), group=self.group)
                h = module(h)
            if s == self.n_stages - 1:
                ls = self.hidden_loss(_unwrap(module), h, y)
                out = (ls.float(), (y != -100).sum().float())
            else:
                dist.send(h.to(self.hidden_dtype).contiguous(), dst=self._peer(s + 1), group=self.group)
        return out

    # ---------------------------------------------------------------------------------------- checkpoints
    def _gather(self, local: dict) -> list[dict] | None:
        """Every stage's ``local`` on rank 0 (a collective of the pipeline group; None elsewhere). Only the
        pipeline of data-parallel rank 0 (the one holding global rank 0) gathers: the others hold copies."""
        if self.info.dp_rank != 0 or self.info.tp_rank != 0:
            return None
        out: list[Any] | None = [None] * self.pp if self.info.rank == 0 else None
        dist.gather_object(local, out, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict, on CPU, on rank 0 (empty elsewhere). A collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.info.sharded:  # every data-parallel rank of the stage gets the gathered tensors
            local = get_model_state_dict(self.view, options=StateDictOptions(full_state_dict=True))
        else:
            local = self.view.state_dict()
        local = {k: v.detach().cpu() for k, v in local.items()} if self.info.dp_rank == 0 else {}
        parts = self._gather(local)
        if parts is None:
            return {}
        full: dict[str, torch.Tensor] = {}
        for part in parts:
            full.update(part)
        return dict(sorted(full.items(), key=lambda kv: _key_order(kv[0])))

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer state of every stage keyed by parameter name, merged on rank 0 (empty elsewhere)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        local = get_optimizer_state_dict(
            self.view, optimizer, options=StateDictOptions(full_state_dict=self.info.sharded)
        )
        local = _to_cpu(local) if self.info.dp_rank == 0 else {}
        parts = self._gather(local)
        if parts is None:
            return {}
        merged: dict[str, Any] = {"state": {}, "param_groups": []}
        for part in parts:
            merged["state"].update(part["state"])
            for i, group in enumerate(part["param_groups"]):
                if i < len(merged["param_groups"]):
                    merged["param_groups"][i]["params"] += list(group["params"])
                else:
                    merged["param_groups"].append({**group, "params": list(group["params"])})
        return merged

    def load_weights(self, state: dict[str, torch.Tensor], where: Any) -> None:
        """Load this rank's stages from the whole model's weights (read from checkpoint ``where``): each rank keeps
        its stages' tensors (its shards under FSDP)."""
        mine = set(self.view.state_dict())
        missing = sorted(mine - set(state))
        if missing:
            raise UserError(
                f"checkpoint {where} does not match the model (missing {missing[:4]}); was it trained with "
                "another --size or family?"
            )
        state = {k: v for k, v in state.items() if k in mine}
        if self.info.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(self.view, state, options=StateDictOptions(full_state_dict=True))
        else:
            self.view.load_state_dict(state)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load this rank's part of a checkpoint's optimizer state: keyed by name (FSDP or pipeline runs), or by
        index (one process or DDP: mapped to names through :attr:`param_order`)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        by_name = any(isinstance(k, str) for k in state.get("state", {})) or any(
            isinstance(p, str) for g in state.get("param_groups", []) for p in g["params"]
        )
        if not by_name:
            order = self.param_order
            state = {
                "state": {order[i]: v for i, v in state["state"].items()},
                "param_groups": [
                    {**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]
                ],
            }
        mine = {n for n, _ in self.view.named_parameters()}
        groups = [{**g, "params": [p for p in g["params"] if p in mine]} for g in state["param_groups"]]
        state = {
            "state": {k: v for k, v in state["state"].items() if k in mine},
            "param_groups": [g for g in groups if g["params"]],
        }
        set_optimizer_state_dict(
            self.view, optimizer, state, options=StateDictOptions(full_state_dict=self.info.sharded)
        )


def _unwrap(module: nn.Module) -> nn.Module:
    inner = getattr(module, "module", None)  # DDP
    return inner if isinstance(inner, nn.Module) else module


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def _key_order(name: str) -> tuple:
    """The whole model's order of names: the embedding, the blocks by index, then the rest."""
    parts = name.split(".")
    if parts[0] == "layers":
        return (1, int(parts[1]), name)
    return (0 if "embed" in parts[0] else 2, 0, name)
