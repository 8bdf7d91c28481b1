"""A run says what it will do, then does exactly that (a newcomer's four seams):

1. a curriculum's phases are in the plan with the step each begins at (a warning for those the run ends before);
   every phase start is announced, the first at step 1, and recorded in metrics.jsonl at its step; a logged row
   names the phase of its own batches, not the next one's;
2. a resume at another batch size plans the tokens the checkpoint saw plus the steps left at the new batch;
3. a run evaluated only at its end writes its end-of-run sample to samples.txt, as the README says;
4. a size's default micro-batch, which the user did not name, is cut like an automatic one: one epoch of a small
   corpus is never one step that reads it more than once."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

from cli_helpers import FASTRUN, ok

# three phases of 256 tokens, 256 tokens and the rest; FASTRUN's steps are 2 rows x 32 tokens = 64 tokens: the
# second phase's first batch is step 5, the third's step 9
PHASES = (("first", "a", 256), ("second", "b", 256), ("third", "c", None))


def _curriculum(tmp_path: Path, corpus: Path) -> Path:
    conf = tmp_path / "conf"
    files = sorted(corpus.iterdir())
    for folder, part in zip("abc", (files[:3], files[3:6], files[6:])):
        (conf / folder).mkdir(parents=True)
        for f in part:
            (conf / folder / f.name).write_text(f.read_text())
    text = 'base = "default"\n[data]\nsources = ["a", "b", "c"]\ntokenizer = "bytes"\n'
    for name, folder, tokens in PHASES:
        text += f'[[data.phases]]\nname = "{name}"\nsources = ["{folder}"]\n'
        text += f"tokens = {tokens}\n" if tokens else ""
    (conf / "run.toml").write_text(text)
    return conf / "run.toml"


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _plan_line(text: str, head: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip().startswith(head)]
    assert lines, text[-2000:]
    return lines[0]


# -------------------------------------------------------------------------------------------- 1. curriculum
def test_the_phase_schedule_follows_the_loaders_rule():
    from gptoughts.training.curriculum import begins_now, phase_schedule

    phases = [SimpleNamespace(name=n, tokens=t) for n, _, t in PHASES]
    steps = [p["step"] for p in phase_schedule(phases, tokens_per_step=64, grad_accum=1)]
    assert steps == [1, 5, 9]
    # the README's phases of 20,000 tokens at the debug size's 8 x 256 tokens a step: steps 1, 11 and 21
    readme = [SimpleNamespace(name=n, tokens=20_000) for n in ("simple", "technical", "mix")]
    assert [p["step"] for p in phase_schedule(readme, tokens_per_step=2048, grad_accum=1)] == [1, 11, 21]
    # accumulation: a phase begins in the step holding its first micro-batch (of 19,000 tokens, the 20th micro-batch
    # of 1,024 tokens, in step 10; at 2,048 tokens a micro-batch, the 11th, step 11)
    odd = [SimpleNamespace(name=n, tokens=19_000) for n in ("simple", "mix")]
    assert [p["step"] for p in phase_schedule(odd, tokens_per_step=2048, grad_accum=2)] == [1, 10]
    assert [p["step"] for p in phase_schedule(odd, tokens_per_step=2048, grad_accum=1)] == [1, 11]
    # a phase shorter than a batch that no batch starts in is never drawn
    short = [
        SimpleNamespace(name="a", tokens=100),
        SimpleNamespace(name="b", tokens=10),
        SimpleNamespace(name="c", tokens=None),
    ]
    assert [p["skipped"] for p in phase_schedule(short, tokens_per_step=64, grad_accum=1)] == [
        False,
        True,
        False,
    ]
    # resumed at another batch size: the phases under way or done at the resume, then this batch's steps
    resumed = phase_schedule(phases, tokens_per_step=32, grad_accum=1, resumed_at=(5, 320))
    assert [(p["step"], p["done"]) for p in resumed] == [(None, True), (None, False), (12, False)]
    sched = phase_schedule(phases, tokens_per_step=64, grad_accum=1)
    assert begins_now(sched, 0, 64) and begins_now(sched, 256, 64) and not begins_now(sched, 320, 64)


def test_every_phase_is_in_the_plan_announced_and_in_the_metrics(tmp_path, text_corpus, cache_dir, capsys):
    toml, out = _curriculum(tmp_path, text_corpus), tmp_path / "run"
    text = ok(
        ["train", str(toml), "--out", str(out), "--max_steps", "12", "--log_interval", "4", *FASTRUN], capsys
    )
    line = _plan_line(text, "curriculum:")
    assert "first (256 tokens) from step 1" in line, line
    assert "second (256 tokens) from step 5" in line and "third (to the end) from step 9" in line, line
    assert "step 1: curriculum phase 'first' begins (the first of 3)" in text, text[-2000:]
    assert "step 5: curriculum phase 'second' begins (after 'first')" in text, text[-2000:]
    assert "step 9: curriculum phase 'third' begins" in text, text[-2000:]
    rows = _rows(out)
    events = [(r["step"], r["phase"]) for r in rows if r.get("event") == "phase"]
    assert events == [(1, "first"), (5, "second"), (9, "third")]
    # each logged row names the phase of its own last batch (it named the next batch's: step 4 said "second")
    logged = {r["step"]: r["phase"] for r in rows if "loss" in r}
    assert logged == {4: "first", 8: "second", 12: "third"}


def test_phases_the_run_ends_before_are_warned_about(tmp_path, text_corpus, cache_dir, capsys):
    toml = _curriculum(tmp_path, text_corpus)
    text = ok(
        ["train", str(toml), "--out", str(tmp_path / "r"), "--max_steps", "3", "--dry_run", *FASTRUN], capsys
    )
    line = _plan_line(text, "curriculum:")
    assert "second (256 tokens) from step 5: not reached" in line, line
    warning = _plan_line(text, "warning: the run ends at step 3")
    assert "'second' (step 5) and 'third' (step 9)" in warning and "at least 9 steps" in warning, warning


def test_a_resumed_run_announces_the_phase_it_begins_or_goes_on_in(tmp_path, text_corpus, cache_dir, capsys):
    toml, out = _curriculum(tmp_path, text_corpus), tmp_path / "run"
    ok(["train", str(toml), "--out", str(out), "--max_steps", "4", *FASTRUN], capsys)
    # the checkpoint at step 4 is the first phase's last step: the resume's first batch begins the second
    text = ok(["train", "--resume", "auto", "--out", str(out), "--max_steps", "6", *FASTRUN], capsys)
    # (it said "the first of 3")
    assert "step 5: curriculum phase 'second' begins (2 of 3)" in text, text[-2000:]
    text = ok(["train", "--resume", "auto", "--out", str(out), "--max_steps", "10", *FASTRUN], capsys)
    assert "step 7: curriculum phase 'second' goes on" in text, text[-2000:]
    assert "step 9: curriculum phase 'third' begins" in text, text[-2000:]
    events = [(r["step"], r["phase"]) for r in _rows(out) if r.get("event") == "phase"]
    assert events == [(1, "first"), (5, "second"), (9, "third")]


# ---------------------------------------------------------------------------------- 2. resume, another batch
def test_a_resume_at_another_batch_plans_the_tokens_seen_plus_the_steps_left(
    tmp_path, text_corpus, cache_dir, capsys
):
    out = tmp_path / "run"
    common = ["--data", str(text_corpus), "--tokenizer", "bytes"]
    ok(
        ["train", *common, "--out", str(out), "--max_steps", "4", *FASTRUN], capsys
    )  # 4 steps of 2 x 32 tokens
    text = ok(["train", "--resume", "auto", "--out", str(out), "--epochs", "3", *FASTRUN[:-2], "--batch_size", "1",
               "--dry_run"], capsys)  # fmt: skip
    line = _plan_line(text, "steps:")
    m = re.search(r"steps: ([\d,]+) \(.*\) = ([\d.]+) epoch\(s\) over the data, ([\d,]+) tokens", line)
    assert m, line
    steps, epochs, tokens = (float(g.replace(",", "")) for g in m.groups())
    assert tokens == 4 * 64 + (steps - 4) * 32, line  # (was steps x 32: every step at the new batch)
    assert abs(epochs - 3) < 0.01, line


# ------------------------------------------------------------------------------- 3. the end-of-run sample
def test_a_run_evaluated_only_at_its_end_writes_its_sample(tmp_path, text_corpus, cache_dir, capsys):
    out = tmp_path / "run"
    text = ok(["train", "--data", str(text_corpus), "--tokenizer", "bytes", "--out", str(out), "--max_steps", "5",
               *FASTRUN], capsys)  # fmt: skip
    assert "eval at the end" in _plan_line(text, "steps:")
    samples = (out / "samples.txt").read_text(encoding="utf-8")
    assert samples.startswith("=== step 5\n"), samples
    summary = json.loads((out / "summary.json").read_text())
    printed = re.search(r"sample \(.*\):\n(.*)done \(", text, re.S)
    assert printed and printed.group(1).strip() in samples, text[-1500:]
    assert summary["steps"] == 5
    # sample_interval 0 still turns them off
    off = tmp_path / "off"
    ok(["train", "--data", str(text_corpus), "--tokenizer", "bytes", "--out", str(off), "--max_steps", "3",
        "--eval.sample_interval", "0", *FASTRUN], capsys)  # fmt: skip
    assert not (off / "samples.txt").exists()


# ------------------------------------------------------------------------------ 4. the size's default batch
def _epochs_line(text: str) -> tuple[int, float, str]:
    line = _plan_line(text, "steps:")
    m = re.search(r"steps: ([\d,]+) .* = ([\d.]+) epoch\(s\)", line)
    assert m, line
    return int(m.group(1).replace(",", "")), float(m.group(2)), line


def test_one_epoch_at_the_default_batch_never_reads_a_small_corpus_twice(
    tmp_path, text_corpus, cache_dir, capsys
):
    # ~100,000 tokens: 5 rows of 20,000, fewer than the debug size's default 8 rows of one step
    common = ["train", "--data", str(text_corpus), "--tokenizer", "bytes", "--size", "debug", "--block_size", "20000",
              "--device", "cpu", "--dry_run"]  # fmt: skip
    text = ok([*common, "--out", str(tmp_path / "a")], capsys)
    steps, epochs, line = _epochs_line(text)
    assert steps > 1 and abs(epochs - 1) <= 0.5 / steps, line  # (was 1 step = 1.6 epochs)
    assert "the default 8" in _plan_line(text, "batch:")
    # a batch the user names is theirs: planned as asked, and warned about
    text = ok([*common, "--out", str(tmp_path / "b"), "--batch_size", "8"], capsys)
    steps, epochs, line = _epochs_line(text)
    assert steps == 1 and epochs > 1.2, line
    assert "only 1 optimizer step(s)" in text
    # with the user's --grad_accum, only the default micro-batch is cut
    text = ok([*common, "--out", str(tmp_path / "c"), "--grad_accum", "2"], capsys)
    assert "x accumulation 2" in _plan_line(text, "batch:") and "the default 8 cut to 1" in text, text[-2000:]


def test_a_default_batch_that_fits_the_corpus_is_left_as_it_is():
    from gptoughts.config import load_config
    from gptoughts.training import batches

    cfg = load_config("default", {"model.size": "debug"})
    why: dict[str, str] = {}
    assert batches._fit_default_batch(cfg, 8, 1, 200 * 256.0, 256, why) == (8, 1) and not why
