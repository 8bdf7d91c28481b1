"""What TensorBoard shows of steps a rollback undid, and where a rollback's own record goes (MetricsLogger)."""

from __future__ import annotations

import json
from pathlib import Path

from gptoughts.training.metrics import MetricsLogger


def _scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _log_steps(m: MetricsLogger, steps: range, loss: float) -> None:
    for s in steps:
        m.log(s, {"loss": loss + s, "skipped_steps": 0})


def test_steps_rolled_back_leave_tensorboard_and_the_rerun_is_one_curve(tmp_path):
    m = MetricsLogger(tmp_path, enabled=True)
    _log_steps(m, range(1, 9), 100.0)  # steps 1-8; 6-8 turn out bad
    m.rewind(4)  # back to the checkpoint of step 4
    m.log(4, {"event": "rollback", "from_step": 8, "to_step": 4, "skipped_steps": 4})
    _log_steps(m, range(5, 11), 200.0)
    m.close()

    tb = _scalars(tmp_path)
    want = [(s, 100.0 + s) for s in range(1, 5)] + [(s, 200.0 + s) for s in range(5, 11)]
    assert tb["train/loss"] == want
    # the rollback's counts are not training series (its skipped_steps is not the window's count)
    assert tb["train/skipped_steps"] == [(s, 0.0) for s in range(1, 11)]
    assert not [t for t in tb if t.endswith(("from_step", "to_step"))], sorted(tb)
    # metrics.jsonl keeps every row, the rollback marking where the re-run begins
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [*range(1, 9), 4, *range(5, 11)]
    assert rows[8]["event"] == "rollback"


def test_an_event_row_is_text_in_tensorboard(tmp_path):
    m = MetricsLogger(tmp_path, enabled=True)
    m.log(3, {"event": "phase", "phase": "code"})
    m.log(3, {"loss": 1.5})
    m.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["train/loss"]
    texts = acc.Tensors("events/phase/text_summary")
    assert [e.step for e in texts] == [3] and b"code" in texts[0].tensor_proto.string_val[0]


def test_samples_of_the_steps_rolled_back_are_dropped(tmp_path):
    """They are generated again by the re-run (as after a resume): samples.txt holds each step once."""
    samples = tmp_path / "samples.txt"
    samples.write_text("=== step 4\nbefore\n=== step 6\nrolled back\n")
    m = MetricsLogger(tmp_path, enabled=True, tensorboard=False)
    m.rewind(4)
    m.close()
    assert samples.read_text() == "=== step 4\nbefore\n"
