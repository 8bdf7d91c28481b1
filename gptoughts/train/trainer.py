"""The one training loop.

Pretraining, fine-tuning, LoRA and masked diffusion all run here; they differ by the model, the data loader
and the objective passed in, never by a copied loop. Speed features (compile, fp8, activation checkpointing,
FSDP) are applied to the model before it reaches the trainer (see ``train/setup.py``).

Host-device synchronisation happens only at log/eval/save intervals: the loss is accumulated on the device,
and a non-finite step is skipped on the device by the fused optimizer (``found_inf``) instead of being checked
from Python.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptoughts.config import RunConfig, TrainConfig
from gptoughts.errors import UserError
from gptoughts.parallel import dist as pdist
from gptoughts.perf.autobatch import free_memory
from gptoughts.perf.timing import GpuMonitor, StepTimer, advice, format_profile, summarize_profile
from gptoughts.train import checkpoint as ckpt
from gptoughts.train.metrics import MetricsLogger, ProgressBar
from gptoughts.train.optim import Schedule, clip_and_step, set_lr

log = logging.getLogger("gptoughts.train")

Batch = tuple[torch.Tensor, ...]


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    best_val_loss: float = math.inf
    evals_without_improvement: int = 0
    lr_scale: float = 1.0
    bad_steps: int = 0
    rollbacks: int = 0
    history: list[dict[str, float]] = field(default_factory=list)


class Trainer:
    def __init__(
        self,
        *,
        model: nn.Module,
        objective: Callable[[nn.Module, Batch], tuple[torch.Tensor, torch.Tensor]],
        optimizer: torch.optim.Optimizer,
        schedule: Schedule,
        loader: Any,
        eval_batches: Callable[[], Iterator[Batch]] | None,
        cfg: TrainConfig,
        run: RunConfig,
        run_dir: Path,
        dist: pdist.DistInfo,
        device: torch.device,
        precision: str,
        metrics: MetricsLogger,
        total_steps: int,
        tokens_per_step: int,
        sample_fn: Callable[[str], str] | None = None,
        static_token_count: bool = True,
        save_weights: Callable[[], nn.Module] | None = None,
        timing: bool = True,
        forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):
        self.model = model
        self.objective = objective
        self.optimizer = optimizer
        self.schedule = schedule
        self.loader = loader
        self.eval_batches = eval_batches
        self.cfg = cfg
        self.run = run
        self.run_dir = run_dir
        self.ckpt_dir = run_dir / "checkpoints"
        self.dist = dist
        self.device = device
        self.precision = precision
        self.metrics = metrics
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.sample_fn = sample_fn
        self.forward_context = forward_context
        # Pretraining batches have no ignored targets: the token count of a step is known without looking at the
        # data, so we avoid an all-reduce of the count each step. SFT batches set this False.
        self.static_token_count = static_token_count
        self.weights_module = save_weights or (lambda: pdist.unwrap(self.model))
        self.state = TrainState()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.fused = bool(getattr(optimizer, "defaults", {}).get("fused"))
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        self.stop_requested = False
        self._interrupts = 0
        inner = self.weights_module()
        self._after_step = getattr(inner, "after_optimizer_step", None)
        self._rank_summed = getattr(inner, "rank_summed_state", None) if dist.enabled else None
        self._model_metrics = getattr(inner, "log_metrics", None)
        self.timer = StepTimer(device, enabled=timing)
        self.split = 1
        self.gpu_monitor = GpuMonitor(device)
        self._logs = 0

    # ------------------------------------------------------------------------------------------ precision
    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision (and the SDPA backend choice) around forward passes."""
        stack = contextlib.ExitStack()
        if self.precision in ("bf16", "fp16"):
            dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
            stack.enter_context(torch.autocast(self.device.type, dtype=dtype))
        stack.enter_context(self.forward_context())
        return stack

    # ------------------------------------------------------------------------------------------- one step
    def _no_sync(self, last: bool) -> contextlib.AbstractContextManager:
        # DDP all-reduces (FSDP reduce-scatters) gradients during backward; skip it on all but the last
        # micro-batch of the step.
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2
            self.model.set_requires_gradient_sync(last)
        elif not last and hasattr(self.model, "no_sync"):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimizer step over grad_accum micro-batches.

        Returns, on the device: this rank's summed token loss, the global target-token count, found_inf.
        """
        accum = self.cfg.grad_accum
        timer = self.timer
        timer.start()
        micro = [next(self.loader) for _ in range(accum)]
        timer.mark("data")
        while True:
            try:
                return self._step_on(micro)
            except torch.OutOfMemoryError:
                rows = micro[0][0].shape[0]
                # One rank cannot change its micro-batch alone: the others would wait in a collective forever.
                if self.dist.enabled or self.split * 2 > rows:
                    raise
                self.optimizer.zero_grad(set_to_none=True)
                self.timer.start()  # drop the failed step's partial marks
                free_memory(self.device)
                self.split *= 2
                self.log_line(f"step {self.state.step}: out of memory; micro-batch halved to {rows // self.split} "
                              f"rows, accumulation doubled (same data, same global batch)")

    def _step_on(self, loaded: list[Batch]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        timer = self.timer
        # After an OOM back-off each loaded batch runs as `split` smaller micro-batches.
        micro = [piece for b in loaded for piece in zip(*(t.chunk(self.split) for t in b))] if self.split > 1 \
            else loaded
        accum = len(micro)
        if self.static_token_count:
            # torch.full, not torch.tensor(host number, device=cuda): the latter is a pageable host-to-device copy
            # that waits for the GPU to drain the previous step, so the GPU idled while the host queued the next
            # one (1b b8 step 214.0 ms before, 210.6 ms after; 125m b128 +1.9% tokens/s; measured in two runs on
            # the same H200 kind, not side by side: bench/BENCHMARKS.md, 2026-11-22).
            n_total = torch.full((), float(sum(b[1].numel() for b in micro) * self.dist.world_size),
                                 device=self.device)
        else:
            n_total = sum((b[1] != -100).sum() for b in micro).float()
            n_total = pdist.all_reduce_sum(n_total, self.dist)
        # DDP averages gradients over ranks; scaling by world_size makes the result the gradient of the global
        # token-mean loss.
        scale = self.dist.world_size / n_total.clamp_min(1.0)
        loss_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro):
            with self._no_sync(i == accum - 1):
                with self.autocast():
                    ls, _ = self.objective(self.model, batch)
                timer.mark("forward")
                loss = ls * scale
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            timer.mark("backward")
            loss_sum += ls.detach().float()

        lr = self.schedule.lr_at(self.state.step) * self.state.lr_scale
        set_lr(self.optimizer, lr)
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        grad_norm, found_inf = clip_and_step(self.optimizer, self.params, max_norm, loss_sum, fused=self.fused,
                                             scaler=self.scaler)
        self.optimizer.zero_grad(set_to_none=True)
        if self._after_step is not None:
            with torch.no_grad():
                for t in self._rank_summed() if self._rank_summed is not None else ():
                    pdist.all_reduce_sum(t, self.dist)  # global statistics: every rank updates alike
                self._after_step()
        timer.mark("optimizer")
        timer.stop()
        self._last_grad_norm = grad_norm.detach()
        self._last_lr = lr
        return loss_sum, n_total, found_inf

    # ------------------------------------------------------------------------------------------- evaluate
    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """(val loss, perplexity) over the fixed validation windows, sharded across ranks."""
        if self.eval_batches is None:
            return math.nan, math.nan
        self.model.eval()
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        count = torch.zeros((), device=self.device, dtype=torch.float64)
        model = pdist.unwrap(self.model) if self.dist.enabled else self.model  # no DDP hooks during eval
        world, rank = self.dist.world_size, self.dist.rank
        n_batches, batch = 0, None
        for i, batch in enumerate(self.eval_batches()):
            n_batches = i + 1
            if i % world != rank:
                continue
            with self.autocast():
                ls, n = self.objective(model, batch)
            total += ls.double()
            count += n.double()
        if self.dist.sharded and n_batches % world and rank >= n_batches % world:
            # Under FSDP every forward is a collective: a rank without a batch in the last round runs one
            # (discarded) forward so that all ranks run the same number.
            with self.autocast():
                self.objective(model, batch)
        self.model.train()
        pdist.all_reduce_sum(total, self.dist)
        pdist.all_reduce_sum(count, self.dist)
        loss = (total / count.clamp_min(1)).item()
        return loss, math.exp(min(loss, 50.0))

    # --------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything but the weights; a collective under FSDP (the optimizer state is gathered to rank 0)."""
        st = asdict(self.state)
        st["best_val_loss"] = float(st["best_val_loss"])
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "trainer": st,
            "optimizer": pdist.optimizer_state(self.weights_module(), self.optimizer, self.dist),
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "loader": self.loader.state_dict(),
            "rng": rng,
        }

    def load_state_dict(self, sd: dict[str, Any], *, restore_loader: bool = True) -> None:
        tr = dict(sd["trainer"])
        self.state = TrainState(**tr)
        pdist.load_optimizer_state(self.weights_module(), self.optimizer, sd["optimizer"], self.dist)
        if self.scaler is not None and sd.get("scaler"):
            self.scaler.load_state_dict(sd["scaler"])
        if restore_loader:
            self.loader.load_state_dict(sd["loader"])
        torch.set_rng_state(sd["rng"]["torch"].cpu())
        if self.device.type == "cuda" and "cuda" in sd["rng"]:
            torch.cuda.set_rng_state(sd["rng"]["cuda"].cpu(), self.device)

    def save(self, *, val_loss: float | None = None, is_best: bool = False) -> None:
        if not self.cfg.checkpoints:
            return
        weights: nn.Module | dict[str, torch.Tensor] = self.weights_module()
        if self.dist.sharded:  # gather the full tensors to rank 0 (every rank takes part)
            weights = pdist.full_state_dict(weights)
        state = self.state_dict()
        if self.dist.is_main:
            ckpt.save(self.ckpt_dir, self.state.step, weights, state, val_loss=val_loss,
                      keep_last=self.cfg.keep_last, is_best=is_best)
        pdist.barrier(self.dist)

    def rollback(self) -> bool:
        """Reload the newest valid checkpoint after repeated non-finite steps; halve the learning rate."""
        path = ckpt.latest_valid(self.ckpt_dir)
        if path is None:
            return False
        ckpt.load_weights(self.weights_module(), path, sharded=self.dist.sharded)
        lr_scale, rollbacks, step = self.state.lr_scale, self.state.rollbacks, self.state.step
        # Keep the loader where it is: replaying the batches that diverged would likely diverge again.
        self.load_state_dict(ckpt.load_state(path, "cpu" if self.dist.sharded else self.device),
                             restore_loader=False)
        self.state.lr_scale = lr_scale * 0.5
        self.state.rollbacks = rollbacks + 1
        self.log_line(f"step {step}: {self.cfg.max_bad_steps} non-finite steps; rolled back to {path.name}, "
                      f"learning rate x{self.state.lr_scale:g}")
        return True

    # -------------------------------------------------------------------------------------------- logging
    def log_line(self, text: str) -> None:
        if self.dist.is_main:
            progress = getattr(self, "progress", None)
            if progress is not None:
                progress.print(text)
            else:
                print(text)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._interrupts += 1
        if self._interrupts > 1:
            raise KeyboardInterrupt
        self.stop_requested = True

    # ---------------------------------------------------------------------------------------------- fit
    def fit(self) -> TrainState:
        cfg = self.cfg
        st = self.state
        self.model.train()
        self.progress = ProgressBar(self.total_steps, st.step, enabled=self.dist.is_main and self.run.progress)
        old_handlers = {}
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                old_handlers[sig] = signal.signal(sig, self._on_signal)
        except ValueError:  # not the main thread (e.g. a notebook executor): no graceful stop
            old_handlers = {}
        sample_every = cfg.eval_interval if cfg.sample_interval is None else cfg.sample_interval
        loss_acc = torch.zeros((), device=self.device)
        bad_acc = torch.zeros((), device=self.device)
        tokens_acc = torch.zeros((), device=self.device)
        steps_in_window = 0
        window_start = time.perf_counter()
        stop_reason = "max steps"
        profiler = _Profiler(self.cfg.profile, self.run_dir / "profile", self.dist.rank)
        try:
            while st.step < self.total_steps:
                profiler.before_step(st.step + 1)
                loss_sum, n_tokens, found_inf = self.train_step()
                profiler.after_step(st.step + 1)
                ok = found_inf == 0
                loss_acc += torch.where(ok, loss_sum, 0.0)
                tokens_acc += torch.where(ok, n_tokens, 0.0)
                bad_acc += found_inf
                st.step += 1
                st.tokens_seen += self.tokens_per_step
                steps_in_window += 1
                at_end = st.step >= self.total_steps

                # Alone, a signal stops at the next step; with several ranks only where they agree (log steps),
                # or one rank would save (a collective under FSDP) while the others start the next step.
                stop = self.stop_requested and not self.dist.enabled
                if st.step % cfg.log_interval == 0 or at_end:
                    stop = self._log(loss_acc, tokens_acc, bad_acc, steps_in_window, window_start)
                    if stop == "diverged":
                        raise UserError(f"training diverged: {st.bad_steps} consecutive non-finite steps and no "
                                        "checkpoint to roll back to; lower --learning_rate or use --precision bf16")
                    stop = stop or self._agree_stop()
                    loss_acc.zero_()
                    tokens_acc.zero_()
                    bad_acc.zero_()
                    steps_in_window = 0
                    window_start = time.perf_counter()

                val_loss, improved = None, False
                if (cfg.eval_interval and st.step % cfg.eval_interval == 0) or at_end:
                    val_loss, improved = self._eval_and_track()
                    if cfg.early_stopping_patience is not None and \
                            st.evals_without_improvement >= cfg.early_stopping_patience:
                        stop, stop_reason = True, "early stopping"
                if self.sample_fn is not None and sample_every and (st.step % sample_every == 0 or at_end):
                    self._sample()
                if (cfg.save_interval and st.step % cfg.save_interval == 0) or improved or at_end or stop:
                    self.save(val_loss=val_loss, is_best=improved)
                if stop:
                    if self.stop_requested:
                        stop_reason = "interrupted (checkpoint saved; resume with --resume auto)"
                    break
        finally:
            profiler.close()
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
            self.progress.close()
        self.stop_reason = stop_reason
        return st

    def _agree_stop(self) -> bool:
        # Ranks may see a signal at different steps; they agree at log intervals so collectives stay aligned.
        if not self.dist.enabled:
            return self.stop_requested
        flag = torch.tensor(float(self.stop_requested), device=self.device)
        return bool(pdist.all_reduce_sum(flag, self.dist).item() > 0)

    def _log(self, loss_acc: torch.Tensor, tokens_acc: torch.Tensor, bad_acc: torch.Tensor, n_steps: int,
             t0: float) -> str | bool:
        st = self.state
        # The only per-interval sync: read the accumulated loss, bad-step count and grad norm together.
        pdist.all_reduce_sum(loss_acc, self.dist)
        stats = torch.stack([loss_acc, tokens_acc, bad_acc, self._last_grad_norm.float()]).tolist()
        loss_total, n_tokens, bad, grad_norm = stats
        good = n_steps - int(bad)
        loss = loss_total / max(1.0, n_tokens) if good else math.nan
        elapsed = time.perf_counter() - t0
        tps = n_steps * self.tokens_per_step / max(elapsed, 1e-9)
        if bad:
            st.bad_steps = st.bad_steps + int(bad) if good == 0 else int(bad)
            self.log_line(f"step {st.step}: {int(bad)} step(s) skipped (non-finite loss or gradient)")
        else:
            st.bad_steps = 0
        row = {"loss": loss, "lr": self._last_lr, "tokens_per_s": tps, "grad_norm": grad_norm,
               "tokens": st.tokens_seen, "epoch": getattr(self.loader, "epoch", None),
               "skipped_steps": int(bad)}
        phase = getattr(self.loader, "phase_name", None)
        if phase is not None:
            row["phase"] = phase
        if self._model_metrics is not None:
            row.update(self._model_metrics())
        breakdown = self.timer.summary()
        gpu = self.gpu_monitor.read()
        row.update(breakdown)
        row.update(gpu)
        self._logs += 1
        if self.dist.is_main and (self._logs in (3, 30) or self._logs % 300 == 0):  # after warm-up, then rarely
            for tip in advice(breakdown, gpu):
                self.log_line(f"[yellow]hint:[/yellow] {tip}")
        if self.dist.is_main:
            self.metrics.log(st.step, {k: v for k, v in row.items() if v is not None})
            self.progress.update(st.step, loss=loss, lr=self._last_lr, tps=tps,
                                 line=f"step {st.step}/{self.total_steps} loss {loss:.4f} lr {self._last_lr:.2e} "
                                      f"{tps:,.0f} tok/s")
        if st.bad_steps >= self.cfg.max_bad_steps:
            if self.cfg.nan_policy == "raise" or not self.rollback():
                return "diverged"
        elif bad and self.cfg.nan_policy == "raise":
            raise UserError(f"non-finite loss at step {st.step} (train.nan_policy = raise)")
        return False

    def _eval_and_track(self) -> tuple[float, bool]:
        st = self.state
        val_loss, ppl = self.evaluate()
        improved = math.isfinite(val_loss) and val_loss < st.best_val_loss - self.cfg.early_stopping_min_delta
        if improved:
            st.best_val_loss = val_loss
            st.evals_without_improvement = 0
        elif math.isfinite(val_loss):
            st.evals_without_improvement += 1
        st.history.append({"step": st.step, "val_loss": val_loss, "val_ppl": ppl})
        if self.dist.is_main:
            self.metrics.log(st.step, {"val_loss": val_loss, "val_ppl": ppl})
            self.log_line(f"step {st.step}: val loss {val_loss:.4f}, perplexity {ppl:.2f}"
                          + (" (best)" if improved else ""))
        return val_loss, improved

    def _sample(self) -> None:
        # Under FSDP every rank generates (each forward gathers parameters from all of them); rank 0 writes.
        if self.sample_fn is None or not (self.dist.is_main or self.dist.sharded):
            return
        self.model.eval()
        texts = []
        for prompt in self.cfg.sample_prompts:
            with self.autocast():
                texts.append(self.sample_fn(prompt))
        self.model.train()
        if not self.dist.is_main:
            return
        with open(self.run_dir / "samples.txt", "a", encoding="utf-8") as f:
            f.write(f"=== step {self.state.step}\n")
            for prompt, text in zip(self.cfg.sample_prompts, texts):
                f.write(f"--- prompt: {prompt!r}\n{text}\n")
        for i, text in enumerate(texts):
            self.metrics.text(f"samples/{i}", text, self.state.step)


class _Profiler:
    """torch.profiler over steps START..END (1-based, inclusive), written as a Chrome/Perfetto trace."""

    def __init__(self, spec: str | None, out_dir: Path, rank: int):
        self.prof = None
        if not spec:
            self.start = self.end = -1
            return
        start, _, end = spec.partition(":")
        self.start, self.end = int(start), int(end)
        self.out_dir = out_dir
        self.rank = rank

    def before_step(self, step: int) -> None:
        if step == self.start:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=acts, record_shapes=True)
            self.prof.__enter__()

    def after_step(self, step: int) -> None:
        if self.prof is not None and step >= self.end:
            self.close()

    def close(self) -> None:
        if self.prof is None:
            return
        self.prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"trace_rank{self.rank}_steps{self.start}-{self.end}.pt.trace.json"
        self.prof.export_chrome_trace(str(path))
        summary = summarize_profile(self.prof, self.end - self.start + 1)
        if summary:  # CUDA runs: where the GPU time went, by kernel category, and its idle gaps, next to the trace
            (self.out_dir / f"kernels_rank{self.rank}_steps{self.start}-{self.end}.json").write_text(
                json.dumps(summary, indent=2))
            log.info("profile steps %d-%d: %s", self.start, self.end, "; ".join(format_profile(summary)))
        log.info("profiler trace written to %s (open in Perfetto or TensorBoard)", path)
        self.prof = None

