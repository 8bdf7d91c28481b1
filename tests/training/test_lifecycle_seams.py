"""A run's life over time, where features meet: interrupts during a save, resumes, branches, rollbacks."""

from __future__ import annotations

import torch
from torch import nn

from gptoughts.training.checkpoint import store


class _CutWrites:
    """A file whose third write is cut by Ctrl-C (the signal handler's KeyboardInterrupt lands inside it)."""

    def __init__(self, f):
        self.f, self.writes = f, 0

    def write(self, b):
        self.writes += 1
        if self.writes == 3:
            raise KeyboardInterrupt
        return self.f.write(b)

    def flush(self):
        self.f.flush()


def test_a_second_ctrl_c_during_a_save_is_an_interrupt_not_a_torch_error(tmp_path, monkeypatch):
    """A second Ctrl-C while state.pt is written: torch.save's zip writer turns the KeyboardInterrupt into a
    RuntimeError ("unexpected pos"), which reached the user as a traceback with exit 1. The save raises the
    interrupt (the CLI's "interrupted", exit 130), leaves no temp dir, and the earlier checkpoint stays intact."""
    model = nn.Linear(4, 4)
    store.save(tmp_path, 1, model, {"x": torch.zeros(8)})
    real = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f: real(obj, _CutWrites(f)))
    try:
        store.save(tmp_path, 2, model, {"big": torch.zeros(100_000), "more": torch.ones(1_000)})
    except KeyboardInterrupt:
        pass
    else:  # pragma: no cover - the assertion below says what happened
        raise AssertionError("the save went through")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]
    assert store.verify(tmp_path / "step_000001") is None


def test_a_resume_drops_the_samples_of_the_steps_it_runs_again(tmp_path):
    """A run killed at step 17 after sampling at 15, resumed from its step-10 checkpoint: metrics.jsonl lost its
    rows after step 10, but samples.txt kept "=== step 15", so the resumed run's own step-15 samples made it twice.
    The samples after the checkpoint's step go as its metrics rows do; the text before them is kept byte for byte."""
    from gptoughts.training.metrics import MetricsLogger

    sections = [f"=== step {s}\n--- prompt: 'a'\na\r\nb \u2028=== step 99\n" for s in (5, 10, 15)]
    (tmp_path / "samples.txt").write_bytes("".join(sections).encode())
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": 1.0}}\n' for s in (5, 10, 15)))
    MetricsLogger(tmp_path, enabled=True, tensorboard=False, resume_step=10).close()
    assert (tmp_path / "samples.txt").read_bytes() == "".join(sections[:2]).encode()
    assert [ln for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1].startswith('{"step": 10')
    MetricsLogger(tmp_path, enabled=True, tensorboard=False, resume_step=10).close()  # nothing more to drop
    assert (tmp_path / "samples.txt").read_bytes() == "".join(sections[:2]).encode()


def test_overwrite_removes_the_replaced_runs_task_scores(tmp_path):
    """`gptoughts eval RUN --tasks t.jsonl` writes RUN/eval_tasks.json; `train --overwrite` into RUN kept it, so the
    new run's folder showed the old model's scores (and a later `eval --tasks other.jsonl` merged them in). What the
    user put beside the run stays."""
    from gptoughts.training import rundir

    (tmp_path / "run.json").write_text('{"family": "llama", "args": {}}')
    (tmp_path / "eval_tasks.json").write_text('{"t": {"acc": 1.0}}')
    (tmp_path / "notes.txt").write_text("mine")
    rundir.clear(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
