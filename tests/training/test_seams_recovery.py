"""The end of a run, instability, evaluation windows and epochs (issue 29, items 4, 5, 10 and 11).

A run never ends "done" with an open streak of non-finite or collapsed steps; a collapsed model (uniform
predictions, zero gradient) is unstable, not "best"; a held-out split shorter than a block is still evaluated
(never a nan val loss); "one epoch" plans one epoch. Faults are injected by wrapping the trainer's objective
(``install_fault`` of test_recovery), through the command line run in this process.
"""

from __future__ import annotations

import json
import math
import re
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_recovery import install_fault, nan_on_calls, wrap_training_objective

import gptoughts
from gptoughts import cli
from gptoughts.training.checkpoint import restore
from gptoughts.training.checkpoint import store as ckpt
from gptoughts.training.trainer import Trainer


def _argv(corpus: Path, out: Path, fast: dict, *extra: str) -> list[str]:
    """The fast settings, logging every step, no periodic evaluation or sampling; ``extra`` (``--key value``
    pairs) wins."""
    settings = {k: v for k, v in fast.items() if k != "train.sample_prompts"}
    settings.update({"train.log_interval": 1, "train.eval_interval": 0, "train.sample_interval": 0})
    settings.update(zip((k.removeprefix("--") for k in extra[::2]), extra[1::2]))
    flags = [f"--{k}={v}" for k, v in settings.items()]
    return ["train", "default", "--data", str(corpus), "--out", str(out), *flags]


def _main(argv: list[str], capsys) -> tuple[int, str, str]:
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _one_line_error(code: int, err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and "Traceback" not in err, err
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    return errors[0]


def _finite_weights(step_dir: Path) -> bool:
    return all(torch.isfinite(t).all() for t in load_file(str(step_dir / ckpt.MODEL_FILE)).values())


# ----------------------------------------------------------------------------- item 4: the end of a run

END = ["--train.max_steps", "12", "--train.save_interval", "4", "--train.max_bad_steps", "5"]


def test_rollback_settles_a_streak_open_at_the_end(
    tmp_path, text_corpus, cache_dir, fast, monkeypatch, capsys
):
    """Steps 10-12 non-finite (fewer than max_bad_steps): the end of the run rolls back to step 8 and trains
    steps 9-12 again on the batches after the streak; the run ends on finite steps and a written checkpoint."""
    install_fault(monkeypatch.setattr, nan_on_calls(10, 12))
    out = tmp_path / "run"
    code, stdout, err = _main(_argv(text_corpus, out, fast, *END, "--train.nan_policy", "rollback"), capsys)
    assert code == 0, err
    assert "3 consecutive non-finite steps at the end of the run; rolled back to step_000008" in stdout
    rows = _rows(out)
    (rb,) = [r for r in rows if r.get("event") == "rollback"]
    assert (rb["from_step"], rb["to_step"]) == (12, 8)
    last = [r for r in rows if "loss" in r][-1]
    assert last["step"] == 12 and math.isfinite(last["loss"]) and last["skipped_steps"] == 0
    assert ckpt.list_steps(out / "checkpoints")[-1] == 12
    assert _finite_weights(ckpt.step_dir(out / "checkpoints", 12))
    state = restore.load_state(ckpt.step_dir(out / "checkpoints", 12))["trainer"]
    assert (state["bad_steps"], state["rollbacks"], state["data_steps_skipped"]) == (0, 1, 4)


def test_skip_policy_fails_a_run_that_ends_in_a_streak(
    tmp_path, text_corpus, cache_dir, fast, monkeypatch, capsys
):
    """The same fault under skip: one line naming the last good checkpoint, exit 2, nothing written after it."""
    install_fault(monkeypatch.setattr, nan_on_calls(10, 12))
    out = tmp_path / "run"
    code, stdout, err = _main(_argv(text_corpus, out, fast, *END), capsys)
    good = out / "checkpoints" / "step_000008"
    assert _one_line_error(code, err) == (
        f"error: training diverged at step 12 (3 consecutive non-finite steps at the end of the run, 0 "
        f"rollbacks); the last good checkpoint is {good}; resume from it with a lower --learning_rate"
    )
    assert "done (" not in stdout
    assert ckpt.list_steps(out / "checkpoints") == [4, 8]


# ------------------------------------------------------------------------------------ item 5: collapse


def install_collapse(monkeypatch: pytest.MonkeyPatch, first: int, last: int | None) -> None:
    """Training calls first..last (None: forever) give what a collapsed model gives: the loss of a uniform
    prediction over the model's outputs, ln(vocab), and a zero gradient (the real loss times zero)."""
    calls = {"n": 0}

    def wrap(model, batch, ls, n):
        calls["n"] += 1
        if calls["n"] >= first and (last is None or calls["n"] <= last):
            return ls * 0.0 + n.float() * math.log(model.output_weight.shape[0])
        return ls

    wrap_training_objective(monkeypatch.setattr, wrap)


COLLAPSE = ["--train.max_steps", "12", "--train.save_interval", "4", "--train.max_bad_steps", "3"]


def test_collapse_under_skip_is_warned_never_best_and_stops(
    tmp_path, text_corpus, cache_dir, fast, monkeypatch, capsys
):
    """Collapsed from step 6 on, evaluated at every save step: one warning line, no checkpoint (and no best)
    from the collapsed steps, and the skip policy's error after max_bad_steps of them."""
    install_collapse(monkeypatch, 6, None)
    out = tmp_path / "run"
    code, stdout, err = _main(_argv(text_corpus, out, fast, *COLLAPSE, "--train.eval_interval", "4"), capsys)
    good = out / "checkpoints" / "step_000004"
    assert _one_line_error(code, err) == (
        f"error: training diverged at step 8 (3 consecutive collapsed steps, 0 rollbacks); the last good "
        f"checkpoint is {good}; resume from it with a lower --learning_rate"
    )
    warnings = [ln for ln in stdout.splitlines() if "collapsed" in ln and "warning" in ln]
    assert len(warnings) == 1 and "step 6" in warnings[0] and "zero gradient" in warnings[0], stdout
    assert ckpt.list_steps(out / "checkpoints") == [4]
    assert ckpt.best_step(out / "checkpoints") == 4
    rows = [r for r in _rows(out) if "loss" in r]
    assert [r.get("collapsed_steps", 0) for r in rows] == [0] * 5 + [1, 1, 1]


def test_collapse_under_rollback_rolls_back_and_finishes(
    tmp_path, text_corpus, cache_dir, fast, monkeypatch, capsys
):
    install_collapse(monkeypatch, 6, 8)
    out = tmp_path / "run"
    code, stdout, err = _main(
        _argv(text_corpus, out, fast, *COLLAPSE, "--train.nan_policy", "rollback"), capsys
    )
    assert code == 0, err
    assert "3 consecutive collapsed steps; rolled back to step_000004" in stdout
    assert ckpt.list_steps(out / "checkpoints")[-1] == 12


def test_collapse_under_stop_stops_at_the_first(tmp_path, text_corpus, cache_dir, fast, monkeypatch, capsys):
    install_collapse(monkeypatch, 6, None)
    out = tmp_path / "run"
    code, _, err = _main(_argv(text_corpus, out, fast, *COLLAPSE, "--train.nan_policy", "stop"), capsys)
    line = _one_line_error(code, err)
    assert (
        line.startswith("error: the model collapsed at step 6 (loss ")
        and "recovery.nan_policy = stop" in line
    )
    assert str(out / "checkpoints" / "step_000004") in line


def test_initial_loss_at_ln_vocab_is_not_a_collapse(tmp_path, text_corpus, cache_dir, fast, capsys):
    """A zero-initialised output layer predicts uniformly at step 1 (loss ln(vocab)), but its gradient is not
    zero: training goes on without a warning."""
    out = tmp_path / "run"
    code, stdout, err = _main(
        _argv(text_corpus, out, fast, "--train.max_steps", "4", "--model.zero_init_output", "true"), capsys
    )
    assert code == 0, err
    first = [r for r in _rows(out) if "loss" in r][0]
    assert first["loss"] == pytest.approx(math.log(320), rel=1e-4) and first["grad_norm"] > 0
    assert "collapsed" not in stdout


# ----------------------------------------------------------------------- item 10: evaluation windows


@pytest.mark.slow
def test_a_held_out_split_shorter_than_a_block_is_evaluated(tmp_path, text_corpus, cache_dir, fast, capsys):
    """The held-out text of the tiny corpus (~1 KiB) is shorter than a block of 2048: the plan says evaluations
    use shorter windows, every evaluation logs a finite val loss, and the summary reports it."""
    out = tmp_path / "run"
    code, stdout, err = _main(
        _argv(
            text_corpus,
            out,
            fast,
            "--train.block_size",
            "2048",
            "--train.batch_size",
            "1",
            "--train.max_steps",
            "4",
            "--train.eval_interval",
            "2",
        ),
        capsys,
    )
    assert code == 0, err
    held_out = int(re.search(r"\+ ([\d,]+) held out", stdout).group(1).replace(",", ""))
    assert held_out < 2048
    warning = [ln for ln in stdout.splitlines() if "warning: the held-out split" in ln]
    assert len(warning) == 1 and "evaluations use windows of" in warning[0], stdout
    vals = [r["val_loss"] for r in _rows(out) if "val_loss" in r]
    assert len(vals) == 2 and all(isinstance(v, float) and math.isfinite(v) for v in vals), vals
    assert "no evaluation" not in stdout and "val loss nan" not in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_val_loss"] == pytest.approx(vals[-1])


# -------------------------------------------------------------------------------------- item 11: epochs


@pytest.mark.parametrize("size", ["125m", "1b"])
def test_one_epoch_plans_one_epoch(size, text_corpus, cache_dir, tmp_path, capsys):
    """A corpus smaller than the size's global batch: one epoch (no stopping rule given) plans about one epoch
    of the train split, the steps times the tokens per step, and the printed line says so."""
    _, _, hist = gptoughts.train(
        data_path=str(text_corpus),
        size=size,
        dry_run=True,
        save_dir=str(tmp_path / "run"),
        **{"perf.device": "cpu", "data.tokenizer": "bytes"},
    )
    b = hist.plan["batch"]
    assert b["stop_rule"].startswith("one epoch")
    assert b["epochs"] == pytest.approx(b["total_steps"] * b["tokens_per_step"] / b["train_tokens"])
    assert abs(b["epochs"] - 1.0) <= 0.5 * b["tokens_per_step"] / b["train_tokens"] + 1e-9
    assert b["total_steps"] >= 20  # a batch larger than the corpus is cut, not taken twice in one step
    printed = re.search(r"steps: ([\d,]+) \(one epoch[^)]*\)\) = ([\d.]+) epoch", capsys.readouterr().out)
    assert printed and int(printed.group(1).replace(",", "")) == b["total_steps"]
    assert float(printed.group(2)) == pytest.approx(b["epochs"], abs=0.005)
    assert float(printed.group(2)) == pytest.approx(1.0, abs=0.03)


def test_no_held_out_text_means_no_evaluation_not_nan(tmp_path, cache_dir, fast, capsys):
    """A corpus of one short document keeps it all for training: no held-out split, so the plan says there is
    no evaluation and the run logs none (never a nan val loss)."""
    corpus = tmp_path / "one.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n\n\nprint(add(1, 2), add(3, 4), add(5, 6))\n")
    out = tmp_path / "run"
    code, stdout, err = _main(
        _argv(corpus, out, fast, "--train.max_steps", "3", "--train.eval_interval", "1"), capsys
    )
    assert code == 0, err
    assert "+ 0 held out" in stdout and "no evaluation (no held-out data)" in stdout
    assert "the run is not evaluated" in stdout and "val loss" not in stdout
    assert not [r for r in _rows(out) if "val_loss" in r]
    assert "no evaluation" in stdout.splitlines()[-3]  # the summary line


def test_an_interrupt_inside_a_streak_says_no_checkpoint_was_written(
    tmp_path, text_corpus, cache_dir, fast, monkeypatch, capsys
):
    """Ctrl-C while steps are non-finite: the save is refused, and the end line says so instead of "checkpoint
    saved"; the exit code is the signal's."""
    original_init = Trainer.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        inner, calls = self.objective, {"n": 0}

        def objective(model, batch):
            ls, n = inner(model, batch)
            if model.training:
                calls["n"] += 1
                if calls["n"] >= 6:
                    ls = ls * math.nan
                if calls["n"] == 7:  # what the SIGINT handler does
                    self.stop_requested, self.stop_signal = True, signal.SIGINT
            return ls, n

        self.objective = objective

    monkeypatch.setattr(Trainer, "__init__", init)
    out = tmp_path / "run"
    code, stdout, _ = _main(_argv(text_corpus, out, fast, *END), capsys)
    assert code == 130
    assert "interrupted (no checkpoint now, the last good one kept; resume with --resume auto)" in stdout
    assert ckpt.list_steps(out / "checkpoints") == [4]


def test_early_stopping_inside_a_streak_settles_it(
    tmp_path, text_corpus, cache_dir, fast, monkeypatch, capsys
):
    """Non-finite from step 10 on, evaluated at every step with patience 1: the first bad step's evaluation does
    not improve (the weights did not move), early stopping ends the run there, and the open streak is settled
    (skip: the error naming the last good checkpoint, step 9's best) instead of "done"."""
    install_fault(monkeypatch.setattr, nan_on_calls(10, None))
    out = tmp_path / "run"
    argv = _argv(
        text_corpus, out, fast, *END, "--train.eval_interval", "1", "--eval.early_stopping_patience", "1"
    )
    code, stdout, err = _main(argv, capsys)
    good = out / "checkpoints" / "step_000009"  # the best of step 9
    assert _one_line_error(code, err) == (
        f"error: training diverged at step 10 (1 consecutive non-finite steps at the end of the run, 0 "
        f"rollbacks); the last good checkpoint is {good}; resume from it with a lower --learning_rate"
    )
    assert [r["step"] for r in _rows(out) if "val_loss" in r] == list(range(1, 11))
