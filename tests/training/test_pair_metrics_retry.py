"""Preference metrics count each trained pair once: an out-of-memory retry runs a step's pairs again, and the
failed attempt's pairs must not stay in the window's reward margin and accuracy."""

import json

import torch

from gptoughts import models
from gptoughts.config import RecoveryConfig, TrainConfig
from gptoughts.parallel.dist import DistInfo
from gptoughts.training.metrics import MetricsLogger
from gptoughts.training.objectives import build_objective
from gptoughts.training.optim import Schedule
from gptoughts.training.recovery import Recovery
from gptoughts.training.state import TrainState
from gptoughts.training.trainer import Trainer


class _PairObjective:
    """The causal loss, with DPO's pair bookkeeping: an attempt on more than 2 rows records a margin of -1 a pair,
    then runs out of memory (as a backward would after the forward recorded them); the retry's rows record +1."""

    def __init__(self) -> None:
        self.causal = build_objective("causal")
        self.sums: torch.Tensor | None = None

    def __call__(self, m, batch):
        rows = float(batch[0].shape[0])
        sign = -1.0 if rows > 2 else 1.0
        add = torch.tensor([sign * rows, rows if sign > 0 else 0.0, rows])
        self.sums = add if self.sums is None else self.sums + add
        if rows > 2:
            raise torch.OutOfMemoryError("fake: more than 2 rows do not fit")
        return self.causal(m, batch)

    def pop_pair_sums(self, training: bool):
        out, self.sums = self.sums, None
        return out


def test_an_out_of_memory_retry_counts_each_pair_once(tmp_path):
    model = models.build_model("llama", models.model_args("llama", "debug", {"vocab_size": 256}))
    x = torch.randint(0, 256, (8, 9))
    state, metrics = TrainState(), MetricsLogger(tmp_path, enabled=True, tensorboard=False)
    where = {"dist": DistInfo(), "device": torch.device("cpu"), "precision": "fp32"}
    t = Trainer(
        model=model,
        objective=_PairObjective(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        schedule=Schedule("constant", 0.1, 1, 0),
        loader=iter([(x[:, :-1], x[:, 1:])]),
        cfg=TrainConfig(batch_size=8, log_interval=1),
        metrics=metrics,
        total_steps=1,
        tokens_per_step=64,
        progress=False,
        profile_dir=tmp_path / "profile",
        state=state,
        recovery=Recovery(state, RecoveryConfig(), metrics=metrics, grad_accum=1, **where),
        **where,
    )
    t.fit()
    metrics.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "dpo/accuracy" in r]
    assert t.split == 4 and len(logged) == 1
    # the 8 pairs that trained, each once: margin +1 and all preferred (the failed attempts' -1s are gone)
    assert logged[0]["dpo/reward_margin"] == 1.0 and logged[0]["dpo/accuracy"] == 1.0
