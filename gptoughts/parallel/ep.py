"""Expert parallelism of the MoE families: each rank holds ``E / ep`` of every MoE layer's routed experts.

``--parallel.ep N`` splits the ranks into groups of ``N`` consecutive ones (the ``ep`` dimension of
``DistInfo.ep_mesh``); rank ``i`` of a group holds experts ``[i E/N, (i+1) E/N)`` of every MoE layer, as DTensors
``Shard(0)`` on that dimension (checkpoints and the optimizer see whole experts). Each rank routes its own tokens
as before, then :class:`ExpertParallelExperts` sends each token copy to the rank of its expert and the outputs
back with ``all_to_all_single`` (autograd through torch's functional collectives). The copies move and are summed
back as ``moe_permute`` / ``moe_combine`` say, with the one-process experts' own functions: the same math and the
same saved tensors (under ``hidden`` the gates travel with the copies, else they weight the sum on the token's
rank). The router, the shared experts and everything else are data-parallel under FSDP2 as without EP; the
experts are sharded by FSDP2 over the ``efsdp`` dimension (the ranks holding the same experts).

The split sizes of the all-to-all are read on the host (they vary with the routing): one sync per MoE layer and
forward (and again when activation checkpointing recomputes the block); ``_dispatch`` says why. Applied by
``training/setup.py`` where tensor parallelism would be; the model code is unchanged (a class swap, as FSDP2's).
Layout and measurements: ``docs/parallel.md``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gptoughts.errors import ConfigError
from gptoughts.models.deepseek.dispatch import plan, row_values
from gptoughts.models.deepseek.moe import GroupedExperts

# Families whose blocks hold routed experts (family name -> how its args name the expert count).
EXPERT_FAMILIES = {"deepseek": "n_routed_experts"}


def check_family(family: str | None, ep: int, *, generic: bool = False, lora: bool = False) -> None:
    """The refusals that need only the family (run before the data is prepared): one-line ConfigErrors."""
    if ep <= 1:
        return
    where = f"--parallel.ep {ep}"
    if generic:
        raise ConfigError(f"{where}: a generic transformers model has no expert-parallel plan; use FSDP")
    if lora:
        raise ConfigError(f"{where}: LoRA runs are data-parallel with DDP; drop --lora or --parallel.ep")
    if family not in EXPERT_FAMILIES:
        raise ConfigError(
            f"{where}: the {family} family has no routed experts to split (expert parallelism is for "
            f"{', '.join(EXPERT_FAMILIES)}); drop --parallel.ep"
        )


def check_ep(family: str | None, args: Any, ep: int, *, generic: bool = False, lora: bool = False) -> None:
    """:func:`check_family`, then an expert count that ``ep`` divides and at least one MoE layer."""
    if ep <= 1:
        return
    check_family(family, ep, generic=generic, lora=lora)
    n = int(getattr(args, EXPERT_FAMILIES[str(family)]))
    if getattr(args, "n_moe_layers", 1) == 0:
        raise ConfigError(f"--parallel.ep {ep}: this model has no MoE layer; drop --parallel.ep")
    if n % ep:
        raise ConfigError(
            f"--parallel.ep {ep}: the {n} routed experts do not split over {ep} ranks; use an ep that divides {n}"
        )


def describe(ep: int, n_experts: int) -> str:
    """The plan's words for the layout."""
    return f"expert parallel x{ep}: {n_experts // ep} of {n_experts} experts a rank, tokens all-to-all"


def expert_modules(model: nn.Module) -> list[GroupedExperts]:
    """The expert-parallel modules of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]


def apply_ep(model: nn.Module, mesh: Any) -> int:
    """Split every :class:`GroupedExperts` of ``model`` over ``mesh["ep"]`` in place (parameter names kept);
    returns how many. Every rank built the same weights from the same seed: each keeps its own slice, no copy."""
    import warnings

    from torch.distributed.tensor import Shard, distribute_tensor

    # Our output (under moe_combine = bmm, a bmm's squeezed view) is never modified in place (MoE adds the shared
    # experts out of place).
    warnings.filterwarnings(
        "ignore", message=r"FSDP2-wrapped module \(FSDPExpertParallelExperts\) returned a view"
    )
    ep_mesh = mesh["ep"]
    modules = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    for m in modules:
        for name in ("w1", "w3", "w2"):
            w = getattr(m, name)
            shard = distribute_tensor(w.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(m, name, nn.Parameter(shard, requires_grad=w.requires_grad))
        m.__class__ = ExpertParallelExperts
        m.ep_group = ep_mesh.get_group()
        m.ep_size = ep_mesh.size()
    return len(modules)


class ExpertParallelExperts(GroupedExperts):
    """:class:`GroupedExperts` whose experts are split over the ranks of ``ep_group`` (set by :func:`apply_ep`):
    the same inputs and outputs, the token copies computed on the rank holding their expert."""

    ep_group: Any
    ep_size: int

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        local = [w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w3, self.w2)]
        # The owner's expert gradient sums the contributions of the ep ranks' tokens, each of whose losses the
        # trainer scaled for an average over all data-parallel ranks; FSDP2 averages over the efsdp ranks only.
        # Dividing by ep makes it the gradient of the global mean loss, as every other parameter's.
        return tuple(_ScaleGrad.apply(w, 1.0 / self.ep_size) for w in local)  # type: ignore[return-value]

    def forward(
        self, x: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Eager even inside a compiled block: the split sizes are new Python ints each step, which a graph would
        # specialise on (a recompilation per step until dynamo gives up); the GEMMs inside run eagerly too.
        return torch.compiler.disable(self._dispatch)(x, idx, gates)

    def _dispatch(
        self, x: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        k = idx.size(1)
        e, ep = self.n_experts, self.ep_size
        local_e = e // ep
        # The token copies sorted by expert, so by the rank holding it: the one-process layout without padding,
        # moved there and back as moe_permute says (models/deepseek/dispatch.py).
        layout = plan(idx, e, 1)
        counts = layout.counts
        # received[r * local_e + j]: copies rank r sends to this rank's expert j
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.ep_group)
        # The one host sync per MoE layer: all_to_all_single takes its split sizes, which vary with the routing,
        # as Python ints (to allocate the output and post each peer's transfer). What could avoid it:
        # docs/parallel.md, "Expert parallelism".
        sizes = torch.cat([counts.view(ep, local_e).sum(1), received.view(ep, local_e).sum(1)]).tolist()
        send, recv = sizes[:ep], sizes[ep:]
        xs, src = self.to_rows(x, layout, k)
        xr = all_to_all_single_autograd(xs, recv, send, self.ep_group)
        # hidden: each copy's gate travels with it and scales its hidden row on the expert's rank, as in one
        # process; sum / bmm: the gates weight the sum over K here on the token's rank.
        gr = None
        if self.combine == "hidden":
            gr = all_to_all_single_autograd(row_values(layout, gates.reshape(-1)), recv, send, self.ep_group)
        # output_size: known on the host already, so no second sync to size the result
        local_ids = torch.repeat_interleave(
            torch.arange(local_e, device=x.device).repeat(ep), received, output_size=sum(recv)
        )
        yr = self._local(xr, local_ids, recv, gr)
        ys = all_to_all_single_autograd(yr, send, recv, self.ep_group)
        return self.from_rows(ys, layout, k, gates, src), counts

    def _local(
        self, xs: torch.Tensor, local_ids: torch.Tensor, recv: list[int], gates: torch.Tensor | None
    ) -> torch.Tensor:
        """This rank's experts on the received rows, in the order they came (``compute`` sorts and restores it),
        each row's hidden activation scaled by its gate when ``gates [rows]`` is given (``moe_combine = hidden``)."""
        if torch.is_grad_enabled():
            return self._local_one(xs, local_ids, gates)
        # Without gradients (evaluation, sampling): one GEMM per source rank. A row's result can depend on the
        # other rows of its GEMM (kernel tiling); ranks that decode the same prompt must get the same bits, or
        # their samples (and so their numbers of collectives) part ways.
        g_parts = [None] * len(recv) if gates is None else gates.split(recv)
        parts = [
            self._local_one(x, ids, g) for x, ids, g in zip(xs.split(recv), local_ids.split(recv), g_parts)
        ]
        return torch.cat(parts) if parts else xs

    def _local_one(self, x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor | None) -> torch.Tensor:
        g = None if gates is None else gates.unsqueeze(1)
        return self.compute(x, ids.unsqueeze(1), g, self.n_experts // self.ep_size)[0]


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None
