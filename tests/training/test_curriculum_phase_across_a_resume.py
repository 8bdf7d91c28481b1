"""A resumed run inside a curriculum phase says it goes on, never that it begins again, whatever batch size it
resumes at: the checkpoint keeps the phase of its last batch (``TrainState.phase``). Judged from the loader's
position at the new batch, a resume at a smaller step (2 rows -> 4 rows of 32 tokens) inside the phase that began
at step 5 said "step 6: curriculum phase 'second' begins" and wrote a second ``{"event": "phase"}`` row for it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_helpers import FASTRUN, ok
from test_plan_then_exactly_that import _curriculum

from gptoughts.training.curriculum import phase_schedule
from gptoughts.training.state import TrainState
from gptoughts.training.trainer import Trainer

PHASES = [SimpleNamespace(name=n, tokens=t) for n, t in (("first", 256), ("second", 256), ("third", None))]


def _first_batch_of_a_session(state: TrainState, consumed: int, batch_rows: int) -> tuple[list[str], list]:
    """What a trainer (no more of it than ``_enter_phase`` reads) says and logs before the first batch it draws,
    with the loader ``consumed`` tokens in, drawing ``batch_rows`` rows of 32 tokens."""
    t = Trainer.__new__(Trainer)
    rows: list = []
    t.loader = SimpleNamespace(
        phase_name="first" if consumed < 256 else "second" if consumed < 512 else "third",
        tokens_consumed=consumed,
        global_batch_size=batch_rows,
        block_size=32,
    )
    t.state, t._phase, t.phases = state, None, phase_schedule(PHASES, tokens_per_step=64, grad_accum=1)
    t.dist, t.metrics = (
        SimpleNamespace(is_main=True),
        SimpleNamespace(log=lambda step, row: rows.append((step, row))),
    )
    lines: list[str] = []
    t.log_line = lines.append
    t._enter_phase()
    return lines, rows


def test_a_resume_at_a_larger_batch_inside_a_phase_goes_on_in_it():
    # 5 steps of 64 tokens: the second phase began at step 5 (its first batch at 256 tokens); resumed at 128
    lines, rows = _first_batch_of_a_session(TrainState(step=5, phase="second"), 320, batch_rows=4)
    assert lines == ["step 6: curriculum phase 'second' goes on (resumed inside it)"] and rows == []


def test_a_resume_whose_first_batch_begins_a_phase_announces_it():
    lines, rows = _first_batch_of_a_session(TrainState(step=4, phase="first"), 256, batch_rows=4)
    assert lines == ["step 5: curriculum phase 'second' begins (2 of 3)"]
    assert rows == [(5, {"event": "phase", "phase": "second"})]


def test_the_phase_of_the_last_batch_is_in_the_state_a_checkpoint_keeps():
    state = TrainState()
    _first_batch_of_a_session(state, 0, batch_rows=2)
    assert state.phase == "first"


@pytest.mark.slow
def test_a_resumed_run_at_another_batch_writes_each_phase_once(tmp_path, text_corpus, cache_dir, capsys):
    toml, out = _curriculum(tmp_path, text_corpus), tmp_path / "run"
    flags = [*FASTRUN[:-2], "--batch_size"]
    ok(["train", str(toml), "--out", str(out), "--max_steps", "5", *flags, "2"], capsys)
    text = ok(["train", "--resume", "auto", "--out", str(out), "--max_steps", "8", *flags, "4"], capsys)
    assert "step 6: curriculum phase 'second' goes on (resumed inside it)" in text, text[-2000:]
    rows = [json.loads(ln) for ln in Path(out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    events = [(r["step"], r["phase"]) for r in rows if r.get("event") == "phase"]
    assert events == [(1, "first"), (5, "second"), (8, "third")]
