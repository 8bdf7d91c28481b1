"""Multiple-choice tasks scored by log-likelihood (``gptoughts eval RUN --tasks FILE.jsonl``)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cli_helpers import run_cli
from torch import nn

from gptoughts.data.tokenizer import bytes_tokenizer
from gptoughts.errors import UserError
from gptoughts.tools.tasks import Example, Task, evaluate_tasks, loglikelihoods, score_task


class Bigram(nn.Module):
    """Logits at position t are a row of a table picked by token t alone: scores we can compute by hand."""

    def __init__(self, vocab: int, table: torch.Tensor | None = None) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(vocab, vocab) if table is None else table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table[x]


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_scores_are_the_log_probabilities_of_the_choice_tokens():
    tok = bytes_tokenizer()
    torch.manual_seed(0)
    model = Bigram(tok.vocab_size, torch.randn(tok.vocab_size, tok.vocab_size))
    pairs = [("the capital is", " paris"), ("ab", "cd"), ("x", "a much longer choice"), ("", "q")]
    got = loglikelihoods(model, tok, pairs, batch_size=3)  # padded batches of unequal lengths
    for (context, choice), score in zip(pairs, got, strict=True):
        ctx = tok.encode(context) or [tok.eos_id]
        full = ctx + tok.encode(choice)
        logp = torch.log_softmax(model(torch.tensor([full]))[0].detach(), dim=-1)
        # Token t is predicted by the logits at t - 1.
        expected = sum(float(logp[t - 1, full[t]]) for t in range(len(ctx), len(full)))
        assert score == pytest.approx(expected, abs=1e-4), (context, choice)
    scored = loglikelihoods(model, tok, pairs, batch_size=3, with_greedy=True)
    for (context, choice), (_score, greedy) in zip(pairs, scored, strict=True):
        ctx = tok.encode(context) or [tok.eos_id]
        full = ctx + tok.encode(choice)
        pred = model(torch.tensor([full]))[0].argmax(-1)
        assert greedy == all(int(pred[t - 1]) == full[t] for t in range(len(ctx), len(full)))
    assert [s for s, _ in scored] == pytest.approx(got)


def test_acc_and_acc_norm_on_a_known_model():
    tok = bytes_tokenizer()
    (a,), (x,) = tok.encode("a"), tok.encode("x")
    table = torch.zeros(tok.vocab_size, tok.vocab_size)
    table[a, x] = 6.0  # after "a" comes "x"; everything else is uniform
    model = Bigram(tok.vocab_size, table)
    task = Task(
        "t",
        Path("t.jsonl"),
        (
            # "q" has the higher sum (1 unlikely token), "xyz" the higher sum per character.
            Example("a", ("xyz", "q"), 0),
            Example("a", ("q", "x"), 1),  # an off-by-one would score both by a uniform row: a tie, choice 0
            Example("a", ("x", "c"), 0),
        ),
    )
    r = score_task(model, tok, task, batch_size=2)
    assert r["examples"] == 3
    assert r["acc"] == pytest.approx(2 / 3) and r["acc_norm"] == 1.0
    greedy = [g for _, g in loglikelihoods(model, tok, [("a", "x"), ("a", "q")], with_greedy=True)]
    assert greedy == [True, False]  # "x" is the argmax after "a"; "q" is not


def test_diffusion_is_refused_in_one_line():
    with pytest.raises(UserError, match="not supported yet"):
        evaluate_tasks(SimpleNamespace(family="llada"), [])


GOOD = {"context": "the capital of france is", "choices": [" paris", " rome"], "answer": 0}


@pytest.mark.parametrize(
    ("rows", "says"),
    [
        (None, "does not exist"),
        ([GOOD, "{not json"], "line 2 is not JSON"),
        ([{"context": "a", "answer": 0}], "line 1 has no 'choices' key"),
        ([GOOD, {**GOOD, "answer": 2}], "line 2: answer 2 is out of range for 2 choices"),
        ([{**GOOD, "choices": [" paris"]}], "line 1 has 1 choice(s); give at least 2"),
        ([{**GOOD, "answer": "0"}], "line 1: 'answer' must be an integer"),
        ([{**GOOD, "choices": "paris"}], "line 1: 'choices' must be a list of strings"),
        ([[1, 2]], "line 1 is not a JSON object"),
        ([], "has no examples"),
    ],
)
def test_malformed_task_files_give_one_line(rows, says, tmp_path, capsys):
    f = tmp_path / "bad.jsonl"
    if rows is not None:
        _write(f, rows)
    # The run does not exist either: the task file is checked before any model is loaded.
    code, text = run_cli(["eval", str(tmp_path / "no_run"), "--tasks", str(f)], capsys)
    assert code == 2 and "Traceback" not in text
    assert str(f) in text and says in text, text
    assert len(text.strip().splitlines()) == 1, text


def test_eval_needs_data_or_tasks(tmp_path, capsys):
    code, text = run_cli(["eval", str(tmp_path)], capsys)
    assert code == 2 and "--data" in text and "--tasks" in text and len(text.strip().splitlines()) == 1


def test_a_run_trained_on_the_answers_scores_above_chance(tmp_path, fast, cache_dir, capsys):
    from gptoughts import cli

    facts = [("france", "paris"), ("italy", "rome"), ("spain", "madrid"), ("japan", "tokyo")]
    corpus = tmp_path / "facts.txt"
    corpus.write_text("".join(f"the capital of {c} is {p}.\n" for c, p in facts) * 200)
    run = tmp_path / "run"
    argv = ["train", "default", "--data", str(corpus), "--out", str(run), "--max_steps", "150"]
    assert (
        cli.main(
            [
                *argv,
                "--eval_interval",
                "150",
                "--lr",
                "3e-3",
                *(f"--{k}={v}" for k, v in fast.items() if k != "train.sample_prompts"),
            ]
        )
        == 0
    )
    capsys.readouterr()
    cities = [p for _, p in facts]
    rows = [
        {"context": f"the capital of {c} is", "choices": [f" {q}" for q in cities], "answer": i}
        for i, (c, _) in enumerate(facts)
    ]
    tasks = _write(tmp_path / "capitals.jsonl", rows)
    both = ["--data", str(corpus), "--max_batches", "2", "--json"]
    code = cli.main(["eval", str(run), "--tasks", str(tasks), "--device", "cpu", *both])
    out = json.loads(capsys.readouterr().out)  # stdout: one JSON object (preparing --data talks on stderr)
    assert code == 0 and out["loss"] > 0
    res = out["tasks"]["capitals"]
    assert res["examples"] == 4 and res["acc"] >= 0.75 and res["acc_norm"] >= 0.75  # chance: 1/4
    assert json.loads((run / "eval_tasks.json").read_text())["capitals"] == res
    code, text = run_cli(["eval", str(run), "--tasks", str(tasks), "--device", "cpu"], capsys)
    assert code == 0 and "capitals" in text and "acc_norm" in text
