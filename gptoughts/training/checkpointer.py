"""The run's checkpoints as the training loop sees them: what a checkpoint holds besides the weights (the trainer
state, optimizer, grad scaler, loader position, RNG), writing one (in the background where that pays), waiting for
it, finding the last good one, and restoring one for a rollback. The formats and writers are ``checkpoint.py``'s.

Sharded runs write sharded (DCP) checkpoints, each rank its own shards, by default in the background; other runs
write the single-file format from rank 0, in the background where that pays (``savers.FileSaver``); a pipeline run
gathers its stages to rank 0 for it (its ranks hold different keys)."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptoughts.config import CheckpointConfig
from gptoughts.errors import UserError
from gptoughts.parallel import dist as pdist
from gptoughts.training.checkpoint import restore, savers, sharded
from gptoughts.training.checkpoint import store as ckpt
from gptoughts.training.state import TrainState

log = logging.getLogger("gptoughts.training")


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler | None:
    """fp16's loss scaler (None at other precisions): the step scales with it, checkpoints keep its state."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None


class Checkpointer:
    """Checkpoints of ``model`` (``weights``: what they hold, the whole model or a LoRA model's adapters) with
    ``optimizer``, ``scaler`` and ``loader`` under ``root``. Constructing it is a collective for sharded runs (the
    sharded saver makes a gloo group of its own)."""

    def __init__(
        self,
        root: Path,
        cfg: CheckpointConfig,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loader: Any,
        dist: pdist.DistInfo,
        device: torch.device,
        weights: nn.Module | None = None,
        scaler: torch.amp.GradScaler | None = None,
        pipeline: Any = None,
    ):
        self.root = root
        self.cfg = cfg
        self.model = model
        self.weights = weights if weights is not None else pdist.unwrap(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = optimizer
        self.loader = loader
        self.scaler = scaler
        # parallel.pp.Pipeline: weights and optimizer state go through it (its ranks hold different stages)
        self.pipeline = pipeline
        self.dist = dist
        self.device = device
        self.saver: savers.ShardedSaver | savers.FileSaver | None = None
        if cfg.checkpoints and dist.sharded and pipeline is None:
            self.saver = savers.ShardedSaver(
                root, rank=dist.rank, async_save=cfg.async_save, keep_last=cfg.keep_last
            )
        elif cfg.checkpoints and dist.is_main:
            self.saver = savers.FileSaver(root, keep_last=cfg.keep_last, background=cfg.async_save)

    @property
    def enabled(self) -> bool:
        return self.cfg.checkpoints

    # ------------------------------------------------------------------------------------------- the state
    def state_dict(self, state: TrainState, *, optimizer: bool = True) -> dict[str, Any]:
        """Everything but the weights; a collective under FSDP (the optimizer state is gathered to rank 0).
        ``optimizer=False``: without the optimizer (a sharded checkpoint holds it in its shards), with every
        rank's RNG state instead (a collective when distributed)."""
        st = asdict(state)
        st["best_val_loss"] = float(st["best_val_loss"])
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        out = {
            "trainer": st,
            "optimizer": (
                None
                if not optimizer
                else self.pipeline.optimizer_state(self.optimizer)
                if self.pipeline is not None
                else pdist.optimizer_state(self.weights, self.optimizer, self.dist)
            ),
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "loader": self.loader.state_dict(),
            "rng": rng,
        }
        if not optimizer:
            # Ranks draw from RNGs seeded apart (diffusion masks, dropout): each gets its own back on a resume
            # at the same world size.
            out["rng_ranks"] = pdist.all_gather_object(rng, self.dist)
        return out

    def load_state_dict(self, sd: dict[str, Any], state: TrainState, *, restore_loader: bool = True) -> None:
        """Load a checkpoint's state into ``state`` (in place), the optimizer, scaler, loader and RNG."""
        state.load(sd["trainer"])
        if sd.get("optimizer") is None and sd.get(ckpt.DCP_FORMAT):
            # A sharded checkpoint: DCP reads this rank's part of the optimizer state into the live optimizer
            sharded.load_dcp(Path(sd[ckpt.DCP_FORMAT]), self.weights, self.optimizer, weights=False)
        elif self.pipeline is not None:
            self.pipeline.load_optimizer_state(self.optimizer, sd["optimizer"])
        else:
            pdist.load_optimizer_state(self.weights, self.optimizer, sd["optimizer"], self.dist)
        if self.scaler is not None and sd.get("scaler"):
            self.scaler.load_state_dict(sd["scaler"])
        if restore_loader:
            self.loader.load_state_dict(sd["loader"])
        ranks = sd.get("rng_ranks")
        rng = ranks[self.dist.rank] if ranks and len(ranks) == self.dist.world_size else sd["rng"]
        torch.set_rng_state(rng["torch"].cpu())
        if self.device.type == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"].cpu(), self.device)

    # -------------------------------------------------------------------------------------------- writing
    def prepare(self, state: TrainState) -> None:
        """After the first step, where the optimizer state exists: the saves' host buffers are allocated and pinned
        now, beside training, not at the first save (ShardedSaver/FileSaver.prepare). Once."""
        if self.saver is None or self.saver.prepared:
            return
        if isinstance(self.saver, savers.ShardedSaver):
            self.saver.prepare(sharded.sharded_state(self.weights, self.optimizer))
        elif self.pipeline is None:
            self.saver.prepare(ckpt.weights_for_file(self.weights)[0], self.state_dict(state))
        else:  # its weights come from a gather at each save
            self.saver.prepared = True

    def write(self, state: TrainState, *, val_loss: float | None, is_best: bool) -> float | None:
        """Write a checkpoint of the current state (the caller decided that it is a good one). Returns, on the rank
        that logs it, how long training stood still for it (the copy to host memory when written in the
        background), else None."""
        meta = {
            "tokens_seen": state.tokens_seen,
            "data_steps_skipped": state.data_steps_skipped,
            "rollbacks": state.rollbacks,
            "lr_scale": state.lr_scale,
        }
        if isinstance(self.saver, savers.ShardedSaver):  # every rank writes its own shards, no gather
            sd = self.state_dict(state, optimizer=False)
            self.saver.save(
                state.step,
                sharded.sharded_state(self.weights, self.optimizer),
                sd if self.dist.is_main else None,
                val_loss=val_loss,
                is_best=is_best,
                meta=meta,
            )
            return self.saver.blocked_s if self.dist.is_main else None
        weights: nn.Module | dict[str, torch.Tensor] = self.weights
        if self.pipeline is not None:  # every stage's tensors gathered to rank 0
            weights = self.pipeline.full_state_dict()
        sd = self.state_dict(state)
        blocked = None
        if self.saver is not None:  # rank 0
            tensors, metadata = (
                ckpt.weights_for_file(weights) if isinstance(weights, nn.Module) else (weights, None)
            )
            self.saver.save(
                state.step,
                tensors,
                sd,
                weights_metadata=metadata,
                val_loss=val_loss,
                is_best=is_best,
                meta=meta,
            )
            blocked = self.saver.blocked_s
        pdist.barrier(self.dist)
        return blocked

    def background_failed(self) -> bool:
        """Whether a background write of this process failed (one process only: the ranks of a run would not
        agree on saving again)."""
        return not self.dist.enabled and isinstance(self.saver, savers.FileSaver) and self.saver.failed()

    def wait(self) -> None:
        """Block until a background checkpoint write is on disk (raises its error, if it failed)."""
        if self.saver is not None:
            self.saver.wait()

    def close(self) -> None:
        """Never leave mid-write (on an error too); frees the staging buffers. A failure is a warning here."""
        if self.saver is None:
            return
        try:
            self.saver.close()
        except (UserError, OSError) as e:  # (a full disk: see FileSaver.wait)
            log.warning("%s", e)

    # ---------------------------------------------------------------------------------- finding, restoring
    def last_good(self, before: int) -> Path | None:
        """The newest intact checkpoint of a step < ``before`` (rank 0 looks, every rank gets the answer)."""
        self.wait()  # the newest one may still be being written
        path = ckpt.latest_valid(self.root, before=before) if self.dist.is_main else None
        return pdist.broadcast_object(path, self.dist)  # type: ignore[return-value]

    def weights_finite(self) -> bool:
        """Whether every trained parameter and floating buffer is finite: one fused max-abs reduction (no
        overflow, unlike a sum of squares, for huge but finite weights) and one sync; a collective when
        distributed (sharded ranks hold different parts)."""
        tensors = [p.detach() for p in self.params]
        tensors += [b for b in pdist.unwrap(self.model).buffers() if b.is_floating_point()]
        local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
        local = [t for t in local if t.numel()]
        bad = torch.zeros((), device=self.device)
        if local:
            norms = torch._foreach_norm(local, math.inf)
            bad = (~torch.stack([n.float().to(self.device) for n in norms]).isfinite()).sum().float()
        return pdist.all_reduce_sum(bad, self.dist).item() == 0

    def load_weights(self, path: Path) -> None:
        if self.pipeline is not None:
            self.pipeline.load_weights(restore.read_model_file(path), path)
        else:
            restore.load_weights(self.weights, path, sharded=self.dist.sharded)

    def load_state(self, path: Path, state: TrainState) -> None:
        """The state of checkpoint ``path`` into ``state`` and the optimizer, scaler and RNG; the loader stays where
        it is (a rollback goes on past the bad batches)."""
        sd = restore.load_state(path, "cpu" if self.dist.sharded else self.device)
        self.load_state_dict(sd, state, restore_loader=False)

    def val_loss_of(self, path: Path) -> float | None:
        """The validation loss recorded with checkpoint ``path`` (read on rank 0, the rank that writes it)."""
        return (ckpt.read_meta(path) if self.dist.is_main else {}).get("val_loss")
