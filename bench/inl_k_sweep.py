"""Speed / quality trade-off of INL-LLM's number of integrator iterations K (``model.n_iterations``).

Quality: for each K, trains the same small INL model (same seed, same batches) for a fixed number of steps on
a slice of the Python standard library with the bytes tokenizer, and reports the held-out loss.
Speed: training steps (forward + backward + AdamW) timed separately, the K values taking turns in rounds,
keeping each K's fastest step, so that load from other processes on a shared machine is filtered out. K = 0 is the same block without integrator (the baseline). The table it prints is the
one in the docstring of ``gptoughts/models/inl.py``, which records the command, machine and result.

    python bench/inl_k_sweep.py                       # K in 0 1 2 4 8 15, 300 steps, 2 seeds (~40 min)
    python bench/inl_k_sweep.py --ks 1 4 --steps 50   # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from gptoughts.data.tokenizer import bytes_tokenizer
from gptoughts.models import build_model, model_args
from gptoughts.training.optim import Schedule, build_adamw


def load_corpus(max_bytes: int, val_every: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of stdlib ``.py`` files in sorted order; every ``val_every``-th file is held out."""
    tok = bytes_tokenizer()
    root = Path(sysconfig.get_paths()["stdlib"])
    train: list[int] = []
    val: list[int] = []
    for i, path in enumerate(sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = tok.encode(text) + [tok.eos_id]
        (val if i % val_every == 0 else train).extend(ids)
        if len(train) >= max_bytes:
            break
    return np.asarray(train, dtype=np.int64), np.asarray(val, dtype=np.int64)


def batches(
    data: np.ndarray, n: int, batch: int, block: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        starts = rng.integers(0, len(data) - block - 1, size=batch)
        w = torch.from_numpy(np.stack([data[s : s + block + 1] for s in starts]))
        out.append((w[:, :-1], w[:, 1:]))
    return out


def _args(k: int, a: argparse.Namespace) -> object:
    overrides = dict(
        d_model=a.d_model, n_layers=a.n_layers, n_heads=a.n_heads, vocab_size=320, max_seq_len=a.block
    )
    return model_args("inl", "debug", overrides | {"n_iterations": k})


def run(k: int, seed: int, train: list, val: list, a: argparse.Namespace) -> dict:
    torch.manual_seed(seed)
    model = build_model("inl", _args(k, a), device="cpu").train()
    opt = build_adamw(model, lr=a.lr, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, fused=False)
    sched = Schedule("cosine", a.lr, a.steps, a.steps // 10, 0.1)
    for step, (x, y) in enumerate(train):
        for g in opt.param_groups:
            g["lr"] = sched.lr_at(step)
        loss = train_step(model, opt, x, y)
    model.eval()
    with torch.no_grad():
        val_loss = statistics.fmean(
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in val
        )
    return {
        "k": k,
        "seed": seed,
        "params": model.num_params(),
        "final_train_loss": loss.item(),
        "val_loss": val_loss,
    }


def train_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


def time_steps(
    ks: list[int], batch: tuple[torch.Tensor, torch.Tensor], a: argparse.Namespace
) -> dict[int, float]:
    """Seconds per training step for each K: the fastest of ``timing_rounds * timing_steps`` steps, the K
    values taking turns round by round. Interference from other processes only ever adds time, so the
    minimum is the estimate least disturbed by it (a median of rounds was measured to be inflated up to
    1.7x on a shared machine)."""
    setups = {}
    for k in ks:
        torch.manual_seed(0)
        model = build_model("inl", _args(k, a), device="cpu").train()
        opt = build_adamw(model, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, fused=False)
        for _ in range(3):  # warm-up: allocator, thread pool, optimizer state
            train_step(model, opt, *batch)
        setups[k] = (model, opt)
    best = {k: math.inf for k in ks}
    for _ in range(a.timing_rounds):
        for k, (model, opt) in setups.items():
            for _ in range(a.timing_steps):
                t0 = time.perf_counter()
                train_step(model, opt, *batch)
                best[k] = min(best[k], time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4, 8, 15])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--n_layers", type=int, default=4)
    p.add_argument("--n_heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--max_bytes", type=int, default=2_000_000)
    p.add_argument("--val_batches", type=int, default=20)
    # One thread by default: on a shared machine, OpenMP threads spin-waiting for a busy core slow a step
    # down by 10x or more (measured), which would swamp the differences between K values.
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timing_rounds", type=int, default=5)
    p.add_argument("--timing_steps", type=int, default=5)
    p.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    train_ids, val_ids = load_corpus(a.max_bytes, val_every=20)
    print(
        f"corpus: {len(train_ids):,} train / {len(val_ids):,} val tokens (bytes); torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}, {a.threads} threads",
        flush=True,
    )
    speed = time_steps(a.ks, batches(train_ids, 1, a.batch, a.block, seed=0)[0], a)
    print(json.dumps({"seconds_per_step": speed}), flush=True)
    results = []
    for seed in a.seeds:
        # The same batches for every K: the differences in the table are the model's, not the sampling's.
        train = batches(train_ids, a.steps, a.batch, a.block, seed=1000 + seed)
        val = batches(val_ids, a.val_batches, a.batch, a.block, seed=7)
        for k in a.ks:
            r = run(k, seed, train, val, a)
            results.append(r)
            print(json.dumps(r), flush=True)

    base = [r for r in results if r["k"] == 0]
    print(
        "\n| K | parameters | ms / step | tokens / s | speed vs K=0 | val loss (nats/byte) | val ppl | Δ loss vs K=0 |"
    )
    print(
        "| -: | ---------: | --------: | ---------: | -----------: | -------------------: | ------: | -----------: |"
    )
    for k in a.ks:
        rows = [r for r in results if r["k"] == k]
        ms = 1e3 * speed[k]
        tps = a.batch * a.block / speed[k]
        vl = statistics.fmean(r["val_loss"] for r in rows)
        spread = (max(r["val_loss"] for r in rows) - min(r["val_loss"] for r in rows)) / 2
        if base:
            b_vl = statistics.fmean(b["val_loss"] for b in base)
            rel, dl = f"{speed[0] / speed[k]:.2f}x", f"{vl - b_vl:+.3f}"
        else:
            rel = dl = "-"
        print(
            f"| {k} | {rows[0]['params']:,} | {ms:.0f} | {tps:,.0f} | {rel} | {vl:.3f} ± {spread:.3f} | "
            f"{math.exp(vl):.2f} | {dl} |"
        )
    if a.json:
        a.json.write_text(
            json.dumps(
                {"config": vars(a) | {"json": str(a.json)}, "speed": speed, "results": results}, indent=2
            )
        )


if __name__ == "__main__":
    main()
