"""Periodic task evaluation during training (``--train.eval_tasks FILE.jsonl``, issue 17)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from test_eval_tasks import Bigram

from gptoughts import api
from gptoughts.config import load_config
from gptoughts.data.tokenizer import bytes_tokenizer
from gptoughts.errors import ConfigError
from gptoughts.tools.task_scorer import read_scorer
from gptoughts.training.checkpoint import restore
from gptoughts.training.checkpoint import store as ckpt
from gptoughts.training.evaluation import combine_task_scores

EXAMPLES = [
    {"context": "def f(x):\n    return", "choices": [" x", " banana"], "answer": 0},
    {"context": "import", "choices": [" os", " zzz", " sys"], "answer": 0},
    {"context": "for i in", "choices": [" range(10):", " qq"], "answer": 0},
    {"context": "class", "choices": [" A:", " 42"], "answer": 1},
    {"context": "x =", "choices": [" 1", "!!"], "answer": 0},
]


def _task(path: Path, rows: list = EXAMPLES) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _run(corpus: Path, out: Path, fast: dict, **kw) -> None:
    o = {**fast, "data.sources": [str(corpus)], "run.out": str(out), "train.max_steps": 4}
    o.update({"train.log_interval": 1, "eval.eval_interval": 0, "eval.sample_interval": 0, **kw})
    api.run_training(load_config("default", o))


@pytest.mark.plots
@pytest.mark.slow
def test_tasks_are_scored_at_their_steps_logged_plotted_and_leave_training_alone(
    tmp_path, text_corpus, cache_dir, fast, monkeypatch, capsys
):
    """Rows ``tasks/NAME/METRIC`` at every interval and at the end, values in [0, 1], a console line, the plan
    line, plots/tasks.png and summary.json; the run's losses, RNG and loader state are those of the same run
    without tasks, even when scoring draws random numbers."""
    from gptoughts.tools.task_scorer import TaskScorer

    original = TaskScorer.__call__

    def draws(self, model, *, shard=(0, 1), stop=None):
        torch.rand(7)  # a scorer that consumes the global RNG (as a diffusion one would): restored around it
        return original(self, model, shard=shard, stop=stop)

    monkeypatch.setattr(TaskScorer, "__call__", draws)
    task = _task(tmp_path / "mc.jsonl")
    _run(text_corpus, tmp_path / "plain", fast, **{"train.max_steps": 5})
    capsys.readouterr()
    run = tmp_path / "tasks"
    _run(
        text_corpus,
        run,
        fast,
        **{"train.max_steps": 5, "train.eval_tasks": [str(task)], "train.eval_tasks_interval": 2},
    )
    text = capsys.readouterr().out
    assert "tasks: mc (5 examples); scored every 2 steps and at the end" in text
    assert "step 2: tasks mc acc " in text and "(5 examples)" in text
    rows = _rows(run)
    scored = {r["step"]: r for r in rows if any(k.startswith("tasks/") for k in r)}
    assert sorted(scored) == [2, 4, 5]
    for r in scored.values():
        keys = {k for k in r if k.startswith("tasks/")}
        assert keys == {"tasks/mc/acc", "tasks/mc/acc_norm"}
        assert all(0.0 <= r[k] <= 1.0 for k in keys)
        assert all(r[k] * 5 == pytest.approx(round(r[k] * 5)) for k in keys)  # hits out of 5 examples
    assert (run / "plots" / "tasks.png").stat().st_size > 1000
    from PIL import Image

    from gptoughts.training.plots import compare_runs

    with Image.open(compare_runs([run, tmp_path / "plain"], tmp_path / "cmp.png")) as png:
        assert png.height > 1200  # a third row: the task scores of the runs that have them
    summary = json.loads((run / "summary.json").read_text())
    assert summary["tasks"]["mc"]["examples"] == 5
    assert summary["tasks"]["mc"]["acc"] == scored[5]["tasks/mc/acc"]

    def losses(r: Path) -> dict:
        return {x["step"]: x["loss"] for x in _rows(r) if "loss" in x}

    assert losses(run) == losses(tmp_path / "plain")
    a, b = (
        restore.load_state(ckpt.latest_valid(r / "checkpoints"), "cpu") for r in (run, tmp_path / "plain")
    )
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])
    assert a["loader"] == b["loader"]


def test_a_malformed_task_file_fails_before_anything_is_written(tmp_path, text_corpus, cache_dir, capsys):
    bad = _task(tmp_path / "bad.jsonl", [EXAMPLES[0], {"context": "a", "choices": ["b"], "answer": 0}])
    out = tmp_path / "run"
    argv = ["train", "--data", str(text_corpus), "--size", "debug", "--tokenizer", "bytes", "--device", "cpu"]
    code, text = run_cli([*argv, "--out", str(out), "--train.eval_tasks", f"{bad},{bad}"], capsys)
    assert code == 2
    assert text.strip() == f"error: {bad} line 2 has 1 choice(s); give at least 2"
    assert not out.exists() and not cache_dir.exists()  # not even the corpus was tokenized


def test_what_periodic_tasks_refuse_in_one_line(tmp_path):
    base = {"eval.eval_tasks": [str(tmp_path / "t.jsonl")]}
    with pytest.raises(ConfigError, match="pipeline parallelism"):
        load_config("default", {**base, "parallel.pp": 2})
    with pytest.raises(ConfigError, match="eval_tasks_interval must be >= 0"):
        load_config("default", {**base, "eval.eval_tasks_interval": -1})
    cfg = load_config("default", {"train.eval_tasks": "a.jsonl,b.jsonl"})  # the old [train] spelling, a list
    assert cfg.eval.eval_tasks == ["a.jsonl", "b.jsonl"] and cfg.eval.eval_tasks_interval is None


def test_slices_scored_by_ranks_add_up_to_the_whole(tmp_path):
    """What each data-parallel rank scores (examples[rank::world]) combines into the one-process scores."""
    tok = bytes_tokenizer()
    torch.manual_seed(0)
    model = Bigram(tok.vocab_size, torch.randn(tok.vocab_size, tok.vocab_size))
    data = _task(tmp_path / "mc.jsonl")
    specs, task_dir = [str(data)], None
    if importlib.util.find_spec("lm_eval") is not None:  # a harness task: scored whole by rank 0 alone
        specs, task_dir = [str(data), "h_mc"], str(_harness_dir(tmp_path, data))
    scorer = read_scorer(specs, task_dir=task_dir).bind(tok, max_len=32, batch_size=3)
    whole = scorer(model)
    assert whole["mc"]["examples"] == 5
    for world in (2, 3, 7):  # 7 ranks: two of them have no example
        parts = [scorer(model, shard=(rank, world)) for rank in range(world)]
        combined = combine_task_scores(parts)
        assert combined["mc"]["examples"] == 5
        for k in ("acc", "acc_norm"):
            assert combined["mc"][k] == pytest.approx(whole["mc"][k])
        if task_dir:
            assert [p["h_mc"]["examples"] for p in parts] == [5] + [0] * (world - 1)
            assert combined["h_mc"]["acc"] == pytest.approx(whole["mc"]["acc"])


def _harness_dir(tmp_path: Path, data: Path) -> Path:
    """A harness task folder with ``h_mc``: the multiple-choice file ``data``, read from disk."""
    tasks = tmp_path / "harness"
    tasks.mkdir()
    (tasks / "h_mc.yaml").write_text(
        f"task: h_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        'output_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\ntarget_delimiter: ""\nmetric_list:\n  - metric: acc\n'
    )
    return tasks


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["fsdp"])  # DDP's split: test_slices_scored_by_ranks_add_up_to_the_whole
def test_ranks_score_like_one_process(strategy, tmp_path, text_corpus, cache_dir, fast):
    """2 gloo FSDP ranks score what one process scores with the run's final weights: every rank scores every
    example and runs the harness (each rank reports its scores; simple_evaluate reported only where LOCAL_RANK
    was 0, and rank 1 crashed).
    ("ddp" also passes here: 2 ranks split the examples and combine them, rank 0 alone runs the harness; left out
    of the suite for its 12 s, the split being tested in-process above.)"""
    import os
    import subprocess
    import sys

    task = _task(tmp_path / "mc.jsonl")
    run = tmp_path / strategy
    opts = [f"--{k}={v}" for k, v in fast.items() if not isinstance(v, list) and k != "train.batch_size"]
    harness = []
    if importlib.util.find_spec("lm_eval") is not None:
        harness = [f"--eval.eval_task_dir={_harness_dir(tmp_path, task)}"]
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "gptoughts",
         "train", "default", "--data", str(text_corpus), "--out", str(run), *opts, "--batch_size", "2",
         "--max_steps", "2", "--eval_interval", "0", "--sample_prompts=", "--parallel.strategy", strategy,
         "--eval_tasks", f"{task},h_mc" if harness else str(task), *harness],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    how = (
        "examples split over 2 data-parallel ranks" if strategy == "ddp" else "by every rank (sharded model)"
    )
    assert how in r.stdout
    logged = next(x for x in _rows(run) if "tasks/mc/acc" in x)
    assert logged["step"] == 2
    loaded = api.load(run, device="cpu")
    scorer = read_scorer([str(task)]).bind(loaded.tokenizer, max_len=32, batch_size=2)
    with torch.no_grad():
        one = scorer(loaded.model.eval())["mc"]
    assert logged["tasks/mc/acc"] == pytest.approx(one["acc"])
    assert logged["tasks/mc/acc_norm"] == pytest.approx(one["acc_norm"])
    if harness:
        assert logged["tasks/h_mc/acc"] == pytest.approx(one["acc"])


def test_a_llada_run_scores_its_tasks_with_the_diffusion_likelihood(tmp_path, text_corpus, cache_dir, fast):
    """Masked-diffusion runs score as `eval --tasks` does (Monte-Carlo likelihood; the mask token bound from
    the run's tokenizer)."""
    task = _task(tmp_path / "mc.jsonl", EXAMPLES[:2])
    run = tmp_path / "llada"
    _run(
        text_corpus,
        run,
        fast,
        **{"model.family": "llada", "train.max_steps": 2, "train.eval_tasks": [str(task)]},
    )
    rows = [r for r in _rows(run) if "tasks/mc/acc" in r]
    assert [r["step"] for r in rows] == [2] and 0.0 <= rows[0]["tasks/mc/acc"] <= 1.0


def test_harness_tasks_are_scored_during_training(tmp_path, text_corpus, cache_dir, fast):
    """lm-evaluation-harness names in eval_tasks (a task folder reading a local file): scored with the live model,
    logged like task files; in a TOML file the names stay names while task files resolve against the file."""
    pytest.importorskip("lm_eval")
    data = _task(tmp_path / "mc.jsonl", EXAMPLES[:3])
    tasks = _harness_dir(tmp_path, data)
    run = tmp_path / "run"
    over = {"train.max_steps": 2, "eval.eval_tasks": ["h_mc", str(data)], "eval.eval_task_dir": str(tasks)}
    _run(text_corpus, run, fast, **over)
    rows = [r for r in _rows(run) if "tasks/h_mc/acc" in r]
    assert [r["step"] for r in rows] == [2]
    assert rows[0]["tasks/h_mc/acc"] == pytest.approx(rows[0]["tasks/mc/acc"])  # the same examples, two paths
    mine = tmp_path / "sub" / "mine.toml"
    mine.parent.mkdir()
    mine.write_text('[eval]\neval_tasks = ["hellaswag", "t.jsonl"]\n')
    assert load_config(str(mine)).eval.eval_tasks == ["hellaswag", str(mine.parent / "t.jsonl")]


@pytest.mark.slow
def test_a_task_failing_while_scored_is_a_warning_and_the_run_goes_on(
    tmp_path, text_corpus, cache_dir, fast, monkeypatch, capsys
):
    from gptoughts.tools.task_scorer import TaskScorer

    def fails(self, model, *, shard=(0, 1), stop=None):
        raise RuntimeError("a metric option the harness rejects")

    monkeypatch.setattr(TaskScorer, "__call__", fails)
    run = tmp_path / "run"
    over = {"train.max_steps": 4, "train.eval_tasks": [str(_task(tmp_path / "mc.jsonl"))]}
    _run(text_corpus, run, fast, **{**over, "train.eval_tasks_interval": 2})
    text = capsys.readouterr().out
    assert "warning: step 2: scoring eval_tasks failed (a metric option the harness rejects)" in text
    assert text.count("scoring eval_tasks failed") == 1  # dropped after the first failure
    assert max(r["step"] for r in _rows(run) if "loss" in r) == 4  # trained to the end
    assert ckpt.latest_valid(run / "checkpoints") is not None


def test_a_stop_asked_for_ends_the_scoring_at_the_next_batch(
    tmp_path, text_corpus, cache_dir, fast, monkeypatch, capsys
):
    """A SIGTERM (a scheduler's, with its grace period) arriving while tasks are scored ends the scoring at the
    next batch: nothing is logged for it, and the run saves and stops as at any interrupt."""
    import os
    import signal

    from gptoughts.tools import tasks as task_lib
    from gptoughts.tools.task_scorer import TaskScorer

    with task_lib.stop_when(lambda: True), pytest.raises(task_lib.Interrupted):
        task_lib.loglikelihoods(Bigram(8), bytes_tokenizer(), [("a", "b")])
    original = TaskScorer.__call__
    batches = []

    def signalled(self, model, *, shard=(0, 1), stop=None):
        os.kill(os.getpid(), signal.SIGTERM)  # the trainer's handler only sets its stop flag
        return original(self, model, shard=shard, stop=lambda: batches.append(1) or stop())

    monkeypatch.setattr(TaskScorer, "__call__", signalled)
    run = tmp_path / "run"
    task = _task(tmp_path / "mc.jsonl")
    over = {"train.max_steps": 50, "train.eval_tasks": [str(task)], "train.eval_tasks_interval": 2}
    _run(text_corpus, run, fast, **over)
    text = capsys.readouterr().out
    assert "task scoring stopped (a stop was asked for)" in text
    assert batches == [1]  # the first batch's check stopped it
    assert not any(k.startswith("tasks/") for r in _rows(run) for k in r)
    steps = [r["step"] for r in _rows(run) if "loss" in r]
    assert max(steps) < 50 and ckpt.latest_valid(run / "checkpoints") is not None
