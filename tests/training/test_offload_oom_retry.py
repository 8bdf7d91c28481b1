"""A step retried after running out of memory on an FSDP2 model (``--parallel.cpu_offload`` on one GPU: FSDP2 with
CPUOffloadPolicy in a process group of one), the case the trainer halves its micro-batch for, and the batch-size
probe, which runs trial steps on that same model.

An exception in the middle of a forward or backward leaves FSDP2 mid-iteration: gathered parameters registered
on the modules, per-module states saying "in backward", the end-of-backward callback marked as queued though it
never ran, and gradients accumulated on the gathered copies. Steps run on that reduce no gradient into some or
all of the shards the optimizer holds: it steps only the others, and on a GPU the sharded saver's
``get_optimizer_state_dict`` then failed with ``KeyError`` (the optimizer's parameters were not the model's).
The runs here fail once at step 0 and must end exactly as a run that started at the smaller micro-batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gptoughts.config import PerfConfig, RecoveryConfig, TrainConfig
from gptoughts.models import build_model, model_args
from gptoughts.parallel.dist import DistInfo, wrap_fsdp
from gptoughts.training.checkpoint import sharded
from gptoughts.training.metrics import MetricsLogger
from gptoughts.training.objectives import build_objective
from gptoughts.training.optim import Schedule
from gptoughts.training.recovery import Recovery
from gptoughts.training.setup import Built, auto_micro_batch, make_optimizer
from gptoughts.training.state import TrainState
from gptoughts.training.trainer import Trainer

BLOCK, ROWS, STEPS = 16, 4, 2


@pytest.fixture
def gloo_group():
    """A process group of one (gloo, an in-memory store), as ``parallel.dist.init`` starts for CPU offload."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _out_of_memory(*_: object) -> None:
    raise torch.OutOfMemoryError("simulated: CUDA out of memory")


class FailOnce:
    """Raises ``torch.OutOfMemoryError`` once, in the trainer's ``call``-th micro-batch (1-based), where a GPU
    allocation can fail: before the model runs (``objective``), in the forward of its first block, or in the
    backward through that block."""

    def __init__(self, trainer: Trainer, *, call: int, where: str):
        self.calls, self.call, self.where, self.fired = 0, call, where, False
        self.objective = trainer.objective
        trainer.objective = self._objective
        self.handle = trainer.model.layers[0].register_forward_hook(self._hook)

    def _due(self, where: str) -> bool:
        return self.calls == self.call and self.where == where and not self.fired

    def _raise(self, *_: object) -> None:
        self.fired = True
        _out_of_memory()

    def _objective(self, model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> object:
        self.calls += 1
        if self._due("objective"):
            self._raise()
        return self.objective(model, batch)

    def _hook(self, module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        if self._due("forward"):
            self._raise()
        if self._due("backward"):
            out.register_hook(self._raise)


def _offloaded(family: str) -> torch.nn.Module:
    """A debug model under FSDP2 with CPU offload, fp32, the same weights at each call."""
    torch.manual_seed(0)
    model = build_model(family, model_args(family, "debug", {"vocab_size": 256, "max_seq_len": 64}))
    return wrap_fsdp(model, "fp32", cpu_offload=True)


def _trainer(
    family: str,
    rows: list[torch.Tensor],
    *,
    batch: int,
    accum: int,
    tmp: Path,
    model: torch.nn.Module | None = None,
) -> Trainer:
    """The real trainer on an offloaded FSDP2 model (``model``, else a new one) with the run's optimizer (AdamW
    over its two parameter groups), fp32 on the CPU, over ``rows`` in order, ``batch`` rows a micro-batch."""
    model = model or _offloaded(family)
    t = TrainConfig(batch_size=batch, grad_accum=accum, learning_rate=1e-2, grad_clip=1.0)
    optimizer = make_optimizer(model, t, PerfConfig(), torch.device("cpu"))
    data = torch.stack(rows)
    batches = [(data[i : i + batch, :-1], data[i : i + batch, 1:]) for i in range(0, len(rows), batch)]
    state, metrics = TrainState(), MetricsLogger(tmp, enabled=False)
    where = {
        "dist": DistInfo(strategy="fsdp", cpu_offload=True),
        "device": torch.device("cpu"),
        "precision": "fp32",
    }
    return Trainer(
        model=model,
        objective=build_objective("causal"),
        optimizer=optimizer,
        schedule=Schedule("constant", t.learning_rate, STEPS, 0),
        loader=iter(batches),
        cfg=t,
        metrics=metrics,
        total_steps=STEPS,
        tokens_per_step=ROWS * 2 * BLOCK,
        progress=False,
        profile_dir=tmp / "profile",
        state=state,
        recovery=Recovery(state, RecoveryConfig(), metrics=metrics, grad_accum=accum, **where),
        **where,
    )


def _assert_same_weights(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    """Equal weights, read as the sharded saver reads them (one process: each shard is the whole tensor)."""
    got, want = (sharded.sharded_state(m)["model"] for m in (model, reference))
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(
            got[name].to_local(),
            tensor.to_local(),
            rtol=0,
            atol=1e-6,
            msg=lambda m, name=name: f"{name}: {m}",
        )


# In the first step's second micro-batch (the first one's gradients are accumulated on the gathered parameters by
# then) or in its first one: before the model ever ran (FSDP not set up yet), in a forward that the later block
# never reached (never gathered yet), in a backward that went through the later block only.
WHERE = [("forward", 2), ("backward", 2), ("objective", 1), ("forward", 1), ("backward", 1)]


@pytest.mark.parametrize("where, call", WHERE)
@pytest.mark.parametrize("family", ["inl", "llama"])
def test_a_step_retried_after_out_of_memory_ends_as_a_run_at_the_smaller_micro_batch(
    gloo_group, tmp_path, family, where, call
):
    torch.manual_seed(1)
    rows = list(torch.randint(0, 256, (ROWS * 2 * STEPS, BLOCK + 1)))

    retried = _trainer(family, rows, batch=ROWS, accum=2, tmp=tmp_path / "retried")
    failure = FailOnce(retried, call=call, where=where)
    retried.fit()
    failure.handle.remove()
    assert failure.fired and retried.split == 2

    model, optimizer = retried.model, retried.optimizer
    # The optimizer steps exactly the model's parameters, and every one of them was trained.
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert stepped == {id(p) for p in model.parameters()}
    assert len(optimizer.state) == len(stepped)
    # What the sharded saver reads after the first step (the reported KeyError): keyed by the model's names.
    state = sharded.sharded_state(model, optimizer)
    assert set(state["optimizer"]["state"]) == set(state["model"])

    smaller = _trainer(family, rows, batch=ROWS // 2, accum=4, tmp=tmp_path / "smaller")
    smaller.fit()
    _assert_same_weights(model, smaller.model)


def test_the_batch_size_probe_leaves_an_offloaded_model_ready_to_train(gloo_group, tmp_path):
    """``train.batch_size = auto`` probes with real steps on the run's own model, offloaded too (one process);
    the sizes that run out of memory in the backward must leave it as a fresh one: trained afterwards, it ends as
    a model the probe never touched."""
    torch.manual_seed(1)
    rows = list(torch.randint(0, 256, (2 * STEPS, BLOCK + 1)))
    model = _offloaded("llama")

    def too_big(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        if out.shape[0] > 2:  # more than 2 rows: out of memory in the backward through this block
            out.register_hook(_out_of_memory)

    handle = model.layers[0].register_forward_hook(too_big)
    best, _ = auto_micro_batch(
        Built(model=model, raw=model),
        build_objective("causal"),
        vocab_size=256,
        block_size=BLOCK,
        precision="fp32",
        perf=PerfConfig(),
        t=TrainConfig(learning_rate=1e-2),
        device=torch.device("cpu"),
        dist=DistInfo(strategy="fsdp", cpu_offload=True),
        parts={"test": "probe"},
        cache_path=str(tmp_path / "autobatch.json"),
    )
    handle.remove()
    assert best == 2

    probed = _trainer("llama", rows, batch=2, accum=1, tmp=tmp_path / "probed", model=model)
    probed.fit()
    fresh = _trainer("llama", rows, batch=2, accum=1, tmp=tmp_path / "fresh")
    fresh.fit()
    _assert_same_weights(probed.model, fresh.model)
