"""The memory layout of a run: activation checkpointing, how the optimizer stores its states, CPU offload.

When a run's estimated peak (``perf/estimate.py``) exceeds the GPU (or ``perf.gpu_memory_gib``), the settings the
user left to their defaults change, in one fixed order from the cheapest in speed to the dearest:

1. activation checkpointing: selective (recomputes the cheap element-wise ops), then full (whole blocks, ~1/3
   more compute);
2. AdamW's moments in bf16 (half their bytes), or 8-bit where torchao is installed and the run is not sharded;
3. CPU offload (FSDP2's CPUOffloadPolicy): fp32 weights, gradients and optimizer states in host memory, which
   must then hold them; the optimizer steps on the CPU.

A dearer step is tried with the cheaper ones from their start again (bf16 states without checkpointing before bf16
states with full checkpointing; offload with the run's own checkpointing first), and the first layout whose
estimate fits is taken. Where none does, the refusal lists each step with the memory it would need.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

# A layout fits when its estimate stays under this share of the GPU: the margin the automatic batch search keeps
# in its real steps (perf/autobatch.py), for evaluation, generation and the allocator's fragmentation.
FIT = 0.9
# Beyond the GPU by more than the estimate's own error (within 3% of measured peaks on an H200,
# bench/BENCHMARKS.md), a run would end out of memory: refused. A run as set between FIT and this, which no
# layout brings under FIT, is left as it is (it may fit).
REFUSE_ABOVE = 1.1

AC_MODES = ("none", "selective", "full")
STATES = ("fp32", "bf16", "8bit")
# Each field of a Layout: its config key (Config.given names it when the user set it) and its flag.
KEYS = {
    "activation_checkpointing": "perf.activation_checkpointing",
    "optimizer_states": "train.optimizer_states",
    "cpu_offload": "parallel.cpu_offload",
}
FLAGS = {
    "activation_checkpointing": "--activation_checkpointing",
    "optimizer_states": "--train.optimizer_states",
    "cpu_offload": "--parallel.cpu_offload",
}


@dataclass(frozen=True)
class Layout:
    activation_checkpointing: str = "none"
    """none, selective or full (``auto`` resolved)."""
    optimizer_states: str = "fp32"
    cpu_offload: bool = False

    def changes(self, start: Layout) -> dict[str, object]:
        """The fields of this layout that differ from ``start``."""
        return {k: v for k, v in asdict(self).items() if getattr(start, k) != v}

    def apply(self, cfg: Any, start: Layout) -> Any:
        """``cfg`` (a Config) with the fields this layout changes from ``start`` set: the others keep their value
        (an ``auto`` stays auto, and says why in the plan)."""
        sections: dict[str, Any] = {}
        for name, value in self.changes(start).items():
            section, key = KEYS[name].split(".")
            sections[section] = replace(sections.get(section, getattr(cfg, section)), **{key: value})
        return replace(cfg, **sections)

    def flags(self, start: Layout) -> str:
        """The command-line flags that turn ``start`` into this layout."""
        return " ".join(f"{FLAGS[k]} {_value(v)}" for k, v in self.changes(start).items())


@dataclass(frozen=True)
class Need:
    """What a layout's estimate needs per process: GPU memory, and host memory for what it offloads there."""

    gpu_gib: float
    host_gib: float = 0.0
    staging_gib: float = 0.0
    """Of ``host_gib``, the host copy background checkpoints keep (``checkpoint.async_save``)."""


@dataclass
class Choice:
    layout: Layout
    """The layout to train with (``start`` when it fits, or when nothing does)."""
    why: dict[str, str]
    """Each changed field -> ``value (auto: why)``, for the plan."""
    need: Need | None
    refusal: str | None = None
    """Nothing fits: the one-line refusal (``layout`` is then ``start``)."""


@dataclass
class LayoutSearch:
    """The settings a run starts from, what it may change, and how much memory there is: :meth:`choose` decides."""

    start: Layout
    measure: Callable[[Layout], Need | None]
    """The estimate of a layout (None: the run cannot be estimated)."""
    gpu_gib: float
    host_gib: float | None
    """Host memory available per process (None: unknown, not checked)."""
    what: str
    """The model, for the refusal (``inl/3b``)."""
    where: str
    """The memory bound, for the reasons and the refusal (``this GPU's 24.0 GiB``)."""
    shape: str
    """The micro-batch estimated (``micro-batch 1 x 2,048 tokens``)."""
    fixed: dict[str, str] = field(default_factory=dict)
    """Fields the chooser must leave as they are -> why (the user set them, or the launch decided)."""
    eight_bit: bool = False
    """8-bit optimizer states are possible (torchao importable, AdamW, not sharded)."""

    def __post_init__(self) -> None:
        self._seen: dict[Layout, Need | None] = {}

    def need(self, layout: Layout) -> Need | None:
        if layout not in self._seen:
            self._seen[layout] = self.measure(layout)
        return self._seen[layout]

    def fits(self, layout: Layout, share: float = FIT) -> bool:
        n = self.need(layout)
        if n is None or n.gpu_gib > share * self.gpu_gib:
            return False
        return not layout.cpu_offload or self.host_gib is None or n.host_gib <= share * self.host_gib

    def candidates(self) -> list[Layout]:
        """Every layout the chooser may take, cheapest first: offload outermost, then the states, then checkpointing
        (each from the start's value up; the fields in ``fixed`` as they are)."""
        s = self.start
        acs = self._up("activation_checkpointing", AC_MODES)
        # 8-bit only where possible, or where the start already has it
        states = [
            v
            for v in self._up("optimizer_states", STATES)
            if v != "8bit" or self.eight_bit or v == s.optimizer_states
        ]
        offloads = [s.cpu_offload] + ([True] if not s.cpu_offload and "cpu_offload" not in self.fixed else [])
        return [
            Layout(ac, st, off)
            for off, st, ac in itertools.product(offloads, states, acs)
            if not (off and st == "8bit")  # torchao's 8-bit states are not sharded (FSDP): refused offloaded
        ]

    def _up(self, name: str, order: tuple[str, ...]) -> list[str]:
        value = getattr(self.start, name)
        return [value] if name in self.fixed else list(order[order.index(value) :])

    def choose(self) -> Choice:
        """The first candidate whose estimate fits under :data:`FIT` of the GPU (and of the host, offloaded); else
        the start when it is within the estimate's error (:data:`REFUSE_ABOVE`); else the start with the
        refusal."""
        if self.need(self.start) is None:
            return Choice(self.start, {}, None)
        chosen = next((c for c in self.candidates() if self.fits(c)), None)
        if chosen is not None:
            return Choice(chosen, self._why(chosen), self.need(chosen))
        if self.fits(self.start, REFUSE_ABOVE):
            return Choice(self.start, {}, self.need(self.start))
        lead = f"{self.what} at {self.shape} needs ~{gib_figure(self.need(self.start).gpu_gib)}, more than {self.where}"
        return Choice(self.start, {}, self.need(self.start), self.refusal(lead))

    def _why(self, chosen: Layout) -> dict[str, str]:
        """Per changed field: the least estimate of the candidates tried before without that change."""
        tried = self.candidates()[: self.candidates().index(chosen)]
        out = {}
        for name, value in chosen.changes(self.start).items():
            without = min(
                n.gpu_gib
                for c in tried
                if getattr(c, name) == getattr(self.start, name) and (n := self.need(c)) is not None
            )
            host = (
                f", and ~{gib_figure(self.need(chosen).host_gib)} of host memory per process"
                + (f" of {gib_figure(self.host_gib)} available" if self.host_gib else "")
                if name == "cpu_offload"
                else ""
            )
            out[name] = (
                f"{_value(value)} (auto: without it the least estimate is ~{gib_figure(without)}, over {FIT:.0%} of "
                f"{self.where}; ~{gib_figure(self.need(chosen).gpu_gib)} with it{host})"
            )
        return out

    def steps(self) -> list[Layout]:
        """The start and each step of the order added to the one before (what the refusal lists): selective and
        full checkpointing, bf16 (and 8-bit) states, offload; fixed fields included, for their figures."""
        out, s = [self.start], self.start
        for name, value in (
            ("activation_checkpointing", "selective"),
            ("activation_checkpointing", "full"),
            ("optimizer_states", "bf16"),
            *([("optimizer_states", "8bit")] if self.eight_bit else []),
        ):
            order = AC_MODES if name == "activation_checkpointing" else STATES
            if order.index(value) > order.index(getattr(s, name)):
                s = replace(s, **{name: value})
                out.append(s)
        if not s.cpu_offload:
            states = "bf16" if s.optimizer_states == "8bit" else s.optimizer_states
            out.append(replace(s, optimizer_states=states, cpu_offload=True))
        return out

    def refusal(self, lead: str) -> str:
        """One line: ``lead``, then what each step of the order, added to those before, would need, then the other
        ways out. A step that changes a field the chooser must leave says why it was not taken."""
        parts, before = [], self.start
        for step in self.steps()[1:]:
            n = self.need(step)
            if n is None:
                continue
            figure, notes = f"~{gib_figure(n.gpu_gib)}", []
            if step.cpu_offload and not self.start.cpu_offload:
                figure += f" and ~{gib_figure(n.host_gib)} of host memory"
                notes += [f"{gib_figure(self.host_gib)} available"] if self.host_gib else []
                if n.staging_gib and not self.fits(step):
                    notes.append(
                        f"~{gib_figure(n.staging_gib)} of it for background checkpoints: --checkpoint.async_save false"
                    )
            fits = self.fits(step)  # only where a fixed field kept it from being chosen
            pinned = [v for k, v in self.fixed.items() if k in step.changes(self.start if fits else before)]
            notes = ["fits"] * fits + pinned + notes
            note = f" ({'; '.join(notes)})" if notes else ""
            parts.append(f"{'+ ' if parts else 'with '}{step.flags(before)} {figure}{note}")
            before = step
        return (
            f"{lead}: {', '.join(parts)}; or lower --batch_size or --block_size, train a smaller --size, or use more "
            "GPUs (FSDP); --ignore_memory_estimate tries anyway"
        )


def fixed_layout(cfg: Any, dist: Any) -> dict[str, str]:
    """The layout's fields the chooser leaves as they are, and why: those the user set (an ``auto`` is not a
    setting), and offload where the launch (``dist``: its processes, tensor and pipeline split) rules it out."""
    out = {}
    for name, key in KEYS.items():
        section, field_name = key.split(".")
        value = getattr(getattr(cfg, section), field_name)
        if cfg.is_given(key) and value != "auto":
            out[name] = f"you set {key} = {_value(value)}"
    strategy = cfg.parallel.strategy
    if "cpu_offload" in out or dist.cpu_offload:
        return out
    if dist.tp > 1 or dist.pp > 1:
        out["cpu_offload"] = "offload is FSDP's alone, not with --parallel.tp or --parallel.pp"
    elif strategy in ("ddp", "none"):
        out["cpu_offload"] = f"not under parallel.strategy = {strategy}"
    elif dist.world_size > 1:  # the process group started without the CPU backend offload's collectives need
        out["cpu_offload"] = "with several processes, pass --parallel.cpu_offload true when launching"
    return out


def _value(v: object) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def gib_figure(g: float) -> str:
    return f"{g:.1f} GiB" if g >= 1 else f"{g * 1024:.1f} MiB"  # (a debug model: a few MiB)
