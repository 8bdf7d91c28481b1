"""Non-finite and loss-spike recovery, through the command line as a user types it.

Faults are injected by wrapping the trainer's objective: the loss sum of chosen training calls is multiplied by
NaN (a non-finite step) or by 100 (a loss spike). Calls are counted per process, so a fault is transient in
time (a rollback or a re-run does not meet it again) unless the pick says otherwise.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gptoughts import cli
from gptoughts.config import load_config
from gptoughts.errors import ConfigError
from gptoughts.training.checkpoint import restore
from gptoughts.training.checkpoint import store as ckpt
from gptoughts.training.trainer import Trainer

BATCH = 4  # train.batch_size of the conftest FAST settings (grad_accum 1, one process)

# pick(call, batch_index, occurrence) -> loss multiplier or None; batch_index numbers distinct batches from 1 in
# the order first seen, occurrence counts how often this batch was seen (2 = its re-run).
Pick = Callable[[int, int, int], "float | None"]


def wrap_training_objective(setattr_: Callable[[object, str, object], None], wrap: Callable) -> None:
    """Wrap the objective of every Trainer built from now on: ``wrap(model, batch, loss_sum, tokens)`` returns the
    loss sum a training call (not an evaluation) reports instead."""
    original_init = Trainer.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        inner = self.objective

        def objective(model, batch):
            ls, n = inner(model, batch)
            return (wrap(model, batch, ls, n) if model.training else ls), n

        self.objective = objective

    setattr_(Trainer, "__init__", init)


def install_fault(setattr_: Callable[[object, str, object], None], pick: Pick) -> dict:
    """Scale the training losses as ``pick`` says; returns the call counters."""
    seen: dict[bytes, list[int]] = {}
    count = {"calls": 0}

    def wrap(model, batch, ls, n):
        count["calls"] += 1
        entry = seen.setdefault(batch[0].numpy().tobytes(), [len(seen) + 1, 0])
        entry[1] += 1
        factor = pick(count["calls"], entry[0], entry[1])
        return ls if factor is None else ls * factor

    wrap_training_objective(setattr_, wrap)
    return count


def nan_on_calls(first: int, last: int | None) -> Pick:
    """NaN for training calls first..last (None: forever)."""
    return lambda call, _b, _o: math.nan if call >= first and (last is None or call <= last) else None


def _argv(corpus: Path, out: Path, fast: dict, *extra: str) -> list[str]:
    """The fast settings, logging every step, no periodic evaluation or sampling; ``extra`` flags win."""
    flags = [f"--{k}={v}" for k, v in fast.items() if k != "train.sample_prompts"]
    defaults = {"--train.log_interval": "1", "--train.eval_interval": "0", "--train.sample_interval": "0"}
    for flag, value in defaults.items():
        if flag not in extra:
            flags += [flag, value]
    return ["train", "default", "--data", str(corpus), "--out", str(out), *flags, *extra]


def _main(argv: list[str], capsys) -> tuple[int, str, str]:
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _segments(rows: list[dict]) -> list[list[int]]:
    """Logged training steps, split at each rollback row."""
    segs: list[list[int]] = [[]]
    for r in rows:
        if r.get("event") == "rollback":
            segs.append([])
        elif "loss" in r:
            segs[-1].append(r["step"])
    return segs


def _one_line_error(code: int, err: str) -> str:
    """Exit 2, no traceback, and the error is one line (stderr also carries the data-preparation log)."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and "Traceback" not in err, err
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    return errors[0]


def _check_checkpoints(run: Path) -> list[int]:
    """Every checkpoint verifies, holds finite weights, and its step, meta and data position agree."""
    root = run / "checkpoints"
    steps = ckpt.list_steps(root)
    for s in steps:
        d = ckpt.step_dir(root, s)
        assert ckpt.verify(d) is None, d
        meta, state = ckpt.read_meta(d), restore.load_state(d)
        tr = state["trainer"]
        assert meta["step"] == tr["step"] == s
        assert meta["data_steps_skipped"] == tr["data_steps_skipped"]
        assert meta["tokens_seen"] == tr["tokens_seen"] == s * BATCH * 32
        assert state["loader"]["rows"] == (s + tr["data_steps_skipped"]) * BATCH, (s, state["loader"], tr)
        assert tr["bad_steps"] == 0
        assert all(torch.isfinite(t).all() for t in load_file(str(d / ckpt.MODEL_FILE)).values()), d
    best = ckpt.best_step(root)
    assert best is None or best in steps
    return steps


@pytest.mark.slow
def test_transient_nan_rolls_back_past_the_bad_batches(
    tmp_path, text_corpus, cache_dir, fast, monkeypatch, capsys
):
    """NaN at steps 6-8: rollback to step 4, the batches of steps 5-8 are never replayed, the LR is halved, the
    step counter restarts at 4 and the run finishes at max_steps with a consistent last checkpoint."""
    install_fault(monkeypatch.setattr, nan_on_calls(6, 8))
    out = tmp_path / "run"
    code, stdout, err = _main(
        _argv(
            text_corpus,
            out,
            fast,
            "--train.max_steps",
            "14",
            "--train.save_interval",
            "4",
            "--train.nan_policy",
            "rollback",
            "--train.max_bad_steps",
            "3",
        ),
        capsys,
    )
    assert code == 0, err
    assert "rolled back to step_000004, skipping the 4 batches of steps 5-8, learning rate x0.5" in stdout
    rows = _rows(out)
    (rb,) = [r for r in rows if r.get("event") == "rollback"]
    assert (rb["step"], rb["from_step"], rb["to_step"], rb["skipped_steps"], rb["lr_scale"]) == (
        4,
        8,
        4,
        4,
        0.5,
    )
    before, after = _segments(rows)
    assert before == list(range(1, 9)) and after == list(range(5, 15))
    lr = {
        (seg, r["step"]): r["lr"] for seg, part in enumerate(_split_rows(rows)) for r in part if "loss" in r
    }
    assert lr[(1, 5)] == pytest.approx(0.5 * lr[(0, 5)])  # same schedule position, halved
    assert [r["skipped_steps"] for r in rows if "loss" in r and r["step"] in (6, 7, 8)][:3] == [1, 1, 1]
    assert _check_checkpoints(out)[-1] == 14
    last = restore.load_state(ckpt.step_dir(out / "checkpoints", 14))["trainer"]
    assert (last["data_steps_skipped"], last["rollbacks"], last["lr_scale"]) == (4, 1, 0.5)


def _split_rows(rows: list[dict]) -> list[list[dict]]:
    parts: list[list[dict]] = [[]]
    for r in rows:
        if r.get("event") == "rollback":
            parts.append([])
        else:
            parts[-1].append(r)
    return parts


def test_permanent_nan_from_init_exits_2_without_checkpoints(tmp_path, text_corpus, cache_dir, fast, capsys):
    out = tmp_path / "run"
    code, _, err = _main(
        _argv(
            text_corpus,
            out,
            fast,
            "--train.max_steps",
            "10",
            "--train.save_interval",
            "2",
            "--train.nan_policy",
            "rollback",
            "--train.max_bad_steps",
            "3",
            "--model.init_std",
            "1e30",
        ),
        capsys,
    )
    line = _one_line_error(code, err)
    assert "training diverged at step 3 (3 consecutive non-finite steps, 0 rollbacks)" in line, line
    assert "no good checkpoint was written" in line, line
    assert ckpt.list_steps(out / "checkpoints") == [] and not (out / "checkpoints" / "best.json").exists()


@pytest.mark.slow
def test_permanent_nan_after_rollbacks_names_the_last_good_checkpoint(
    tmp_path, text_corpus, cache_dir, fast, monkeypatch, capsys
):
    """save_interval (2) <= max_bad_steps (2): the error is still reached, after max_rollbacks rollbacks."""
    install_fault(monkeypatch.setattr, nan_on_calls(6, None))
    out = tmp_path / "run"
    code, stdout, err = _main(
        _argv(
            text_corpus,
            out,
            fast,
            "--train.max_steps",
            "20",
            "--train.save_interval",
            "2",
            "--train.nan_policy",
            "rollback",
            "--train.max_bad_steps",
            "2",
            "--train.max_rollbacks",
            "2",
            "--train.eval_interval",
            "2",
        ),
        capsys,
    )
    line = _one_line_error(code, err)
    good = out / "checkpoints" / "step_000004"
    assert line == (
        f"error: training diverged at step 6 (2 consecutive non-finite steps; recovery.max_rollbacks = 2 "
        f"reached, 2 rollbacks); the last good checkpoint is {good}; resume from it with a lower "
        f"--learning_rate"
    ), line
    assert stdout.count("rolled back to step_000004") == 2
    assert "checkpoint not written (the last 1 step(s) were non-finite)" in stdout
    assert _check_checkpoints(out) == [2, 4]
    assert ckpt.best_step(out / "checkpoints") in (2, 4)  # evaluated at every save step: never a bad one


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["stop", "raise", "skip", "rollback"])
def test_policies_differ_on_the_same_fault(
    policy, tmp_path, text_corpus, cache_dir, fast, monkeypatch, capsys
):
    install_fault(monkeypatch.setattr, nan_on_calls(6, 8))
    out = tmp_path / "run"
    code, stdout, err = _main(
        _argv(
            text_corpus,
            out,
            fast,
            "--train.max_steps",
            "10",
            "--train.save_interval",
            "4",
            "--train.nan_policy",
            policy,
            "--train.max_bad_steps",
            "3",
        ),
        capsys,
    )
    good = out / "checkpoints" / "step_000004"
    if policy in ("stop", "raise"):  # the first non-finite step stops the run
        assert _one_line_error(code, err) == (
            f"error: non-finite loss or gradient at step 6 (recovery.nan_policy = "
            f"stop); the last good checkpoint is {good}; resume from it with a "
            f"lower --learning_rate"
        )
        assert max(_segments(_rows(out))[0]) == 6
    elif policy == "skip":  # skipped until max_bad_steps in a row, then an error
        assert _one_line_error(code, err) == (
            f"error: training diverged at step 8 (3 consecutive non-finite steps, "
            f"0 rollbacks); the last good checkpoint is {good}; resume from it "
            f"with a lower --learning_rate"
        )
        assert "1 step(s) skipped (non-finite loss or gradient)" in stdout
    else:  # rolled back and finished
        assert code == 0, err
        assert _segments(_rows(out)) == [list(range(1, 9)), list(range(5, 11))]
    assert _check_checkpoints(out)[0] == 4


def test_skip_policy_drops_a_short_streak(tmp_path, text_corpus, cache_dir, fast, monkeypatch, capsys):
    install_fault(monkeypatch.setattr, nan_on_calls(3, 4))
    out = tmp_path / "run"
    code, _, err = _main(
        _argv(
            text_corpus,
            out,
            fast,
            "--train.max_steps",
            "6",
            "--train.save_interval",
            "3",
            "--train.max_bad_steps",
            "3",
        ),
        capsys,
    )
    assert code == 0, err
    rows = [r for r in _rows(out) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 0, 0]
    assert _check_checkpoints(out) == [6]  # step 3 was inside the streak: not written


def test_bad_recovery_settings_are_one_line_errors(tmp_path, text_corpus, cache_dir, fast, capsys):
    assert (
        load_config("default", {"train.nan_policy": "raise"}).recovery.nan_policy == "raise"
    )  # old keys load
    with pytest.raises(ConfigError, match="nan_policy"):
        load_config("default", {"train.nan_policy": "retry"})
    code, _, err = _main(
        _argv(text_corpus, tmp_path / "r", fast, "--train.max_steps", "2", "--train.max_bad_steps", "0"),
        capsys,
    )
    assert _one_line_error(code, err) == "error: recovery.max_bad_steps must be >= 1, got 0"


SPIKE = [
    "--train.max_steps",
    "16",
    "--train.log_interval",
    "4",
    "--train.save_interval",
    "0",
    "--train.spike_warmup_steps",
    "6",
]


def _train_losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _rows(run) if "loss" in r}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["transient", "reproducible"])
def test_loss_spike_is_rerun_and_classified(
    kind, tmp_path, text_corpus, cache_dir, fast, monkeypatch, capsys
):
    """Batch 10 gives 100x its loss once (transient) or every time (reproducible). The spike is held back on the
    device, re-run from the same state at the log step, and reported; a transient one leaves the run identical
    to a clean one."""
    clean = tmp_path / "clean"
    assert _main(_argv(text_corpus, clean, fast, *SPIKE), capsys)[0] == 0
    assert not [r for r in _rows(clean) if r.get("event")]

    if kind == "transient":
        install_fault(
            monkeypatch.setattr, lambda _c, batch, seen: 100.0 if batch == 10 and seen == 1 else None
        )
    else:
        install_fault(monkeypatch.setattr, lambda _c, batch, _s: 100.0 if batch == 10 else None)
    out = tmp_path / kind
    code, stdout, err = _main(_argv(text_corpus, out, fast, *SPIKE), capsys)
    assert code == 0, err
    (spike,) = [r for r in _rows(out) if r.get("event") == "spike"]
    assert spike["step"] == 10 and spike["kind"] == kind
    assert spike["spike_loss"] > 10 * spike["threshold"]
    a, b = _train_losses(clean), _train_losses(out)
    assert sorted(a) == sorted(b) == [4, 8, 12, 16]
    weights_a = load_file(str(clean / "checkpoints" / "step_000016" / ckpt.MODEL_FILE))
    weights_b = load_file(str(out / "checkpoints" / "step_000016" / ckpt.MODEL_FILE))
    same = all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    if kind == "transient":
        assert "transient, kept the re-run" in stdout
        assert spike["rerun_loss"] < spike["threshold"]
        assert a == b and same  # bit-identical to the run without the fault
    else:
        assert "reproducible spike, step dropped" in stdout
        assert spike["rerun_loss"] == pytest.approx(spike["spike_loss"])
        assert a[8] == b[8] and not same
        assert [r.get("dropped_spikes") for r in _rows(out) if r.get("step") == 12 and "loss" in r] == [1]
    _check_checkpoints(out)


DRIVER = """
import os, signal, sys, time
sys.path.insert(0, {tests!r})
from test_recovery import install_fault, nan_on_calls
from gptoughts import cli
from gptoughts.training.checkpoint import store as ckpt
from gptoughts.training.trainer import Trainer

install_fault(setattr, nan_on_calls(6, 8))
where = os.environ["KILL_AT"]

def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)

if where == "after_rollback_line":
    from gptoughts.training import recovery
    line = recovery.log_line
    def log_line(text, dist):
        line(text, dist)
        if "rolled back to" in text:
            die()
    recovery.log_line = log_line
elif where == "mid_replace":  # between the two renames of the checkpoint the rollback re-saves
    def replace(final, tmp, root):
        final.rename(root / f".old-{{final.name}}-{{time.monotonic_ns()}}")
        die()
    ckpt._replace = replace
else:  # after_resave: in the first step after the rollback
    step = Trainer.train_step
    def train_step(self):
        if self.state.rollbacks:
            die()
        return step(self)
    Trainer.train_step = train_step
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["after_rollback_line", "mid_replace", "after_resave"])
def test_sigkill_while_rolling_back_then_resume(kill_at, tmp_path, text_corpus, cache_dir, fast, capsys):
    out = tmp_path / "run"
    driver = DRIVER.format(tests=str(Path(__file__).parent))
    argv = _argv(
        text_corpus,
        out,
        fast,
        "--train.max_steps",
        "12",
        "--train.save_interval",
        "4",
        "--train.nan_policy",
        "rollback",
        "--train.max_bad_steps",
        "3",
    )
    env = {**os.environ, "KILL_AT": kill_at, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "-c", driver, *argv], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == -9, r.stderr[-2000:]
    assert "rolled back to step_000004" in r.stdout
    root = out / "checkpoints"
    if kill_at == "mid_replace":
        assert not (root / "step_000004").exists() and list(root.glob(".old-step_000004-*"))

    code, _, err = _main(["train", "--out", str(out), "--resume", "auto"], capsys)  # no fault this time
    assert code == 0, err
    assert not list(root.glob(".old-*")) and not list(root.glob(".tmp-*"))
    steps = _check_checkpoints(out)
    assert steps[-1] == 12
    last = restore.load_state(ckpt.step_dir(root, 12))["trainer"]
    # Killed before the rollback was recorded: the resume starts again from the old step 4 and meets no fault.
    # Killed after: the resume continues the rolled-back run (data past the bad batches, halved learning rate).
    expected = (4, 1, 0.5) if kill_at == "after_resave" else (0, 0, 1.0)
    assert (last["data_steps_skipped"], last["rollbacks"], last["lr_scale"]) == expected
    segments = _segments(_rows(out))
    assert all(seg == sorted(set(seg)) for seg in segments)  # strictly increasing within each segment
    assert segments[-1][-1] == 12
