"""Task files (``gptoughts eval RUN [RUN ...] --tasks FILE.jsonl``): multiple choice scored by log-likelihood, generation
scored by greedy decoding, causal and masked-diffusion models, several runs compared."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import run_cli
from torch import nn

from gptoughts.data.tokenizer import bytes_tokenizer
from gptoughts.errors import UserError
from gptoughts.tools.tasks import (
    Example,
    GenExample,
    Task,
    generate_until,
    loglikelihoods,
    score_task,
)


class Bigram(nn.Module):
    """Logits at position t are a row of a table picked by token t alone: scores we can compute by hand, and a
    greedy continuation we can follow by hand. It speaks enough of the model protocol for ``sampling.generate``
    (hidden states are one-hot tokens, the head is the table; the cache is not needed: a bigram reads only the
    last token)."""

    def __init__(self, vocab: int, table: torch.Tensor | None = None, max_seq_len: int = 64) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(vocab, vocab) if table is None else table)
        self.args = SimpleNamespace(max_seq_len=max_seq_len)

    @property
    def output_weight(self) -> torch.Tensor:
        return self.table.T

    def new_cache(self, *args, **kwargs) -> None:
        return None

    def forward(self, x: torch.Tensor, *, cache=None, return_hidden: bool = False) -> torch.Tensor:
        if return_hidden:
            return F.one_hot(x, self.table.size(0)).float()
        return self.table[x]


class FirstToken(Bigram):
    """A bidirectional "model" whose logits at every position are the table row of the sequence's first token
    (never masked: it belongs to the prompt). A masked token's cross-entropy is then known whatever else is
    masked, so LLaDA's estimator is exact on an answer of one repeated token."""

    def __init__(self, vocab: int, table: torch.Tensor, mask_id: int) -> None:
        super().__init__(vocab, table)
        self.args.mask_token_id = mask_id

    def forward(self, x: torch.Tensor, *, cache=None, return_hidden: bool = False) -> torch.Tensor:
        first = x[:, :1].expand_as(x)
        return F.one_hot(first, self.table.size(0)).float() if return_hidden else self.table[first]


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


def _ids(tok, text: str) -> int:
    (i,) = tok.encode(text)
    return i


def _chain(tok) -> Bigram:
    """Greedy: "a" -> "b" -> "c" -> newline -> eos (an all-zero row's argmax is id 0, the eos)."""
    table = torch.zeros(tok.vocab_size, tok.vocab_size)
    for prev, nxt in (("a", "b"), ("b", "c"), ("c", "\n")):
        table[_ids(tok, prev), _ids(tok, nxt)] = 5.0
    return Bigram(tok.vocab_size, table, max_seq_len=16)


def test_generation_exact_match_on_a_known_model():
    tok = bytes_tokenizer()
    model = _chain(tok)
    prompts = ["xa", "b", "yb", "zzzzzzzzzzzzzzzzzzzzzzzzzzzzzza"]  # lengths 2, 1, 2 and over max_seq_len
    want = ["bc", "c", "c", "bc"]
    for batch_size in (1, 3):  # grouped by length, batches of one length, order kept
        got = generate_until(model, tok, prompts, until=["\n"], max_new_tokens=6, batch_size=batch_size)
        assert got == want
    assert generate_until(model, tok, ["a"], until=["c"], max_new_tokens=6) == ["b"]
    # Eos ends a row: nothing of what follows it (the eos text, more eos) reaches the text.
    assert generate_until(model, tok, ["a"], until=["#"], max_new_tokens=6) == ["bc\n"]
    with pytest.raises(UserError, match="leaves no room for a prompt"):
        generate_until(model, tok, ["a"], until=["\n"], max_new_tokens=17)
    task = Task(
        "g",
        Path("g.jsonl"),
        (
            GenExample("xa", " bc "),  # compared stripped
            GenExample("a", "b", until=("c",)),
            GenExample("b", "cc"),
            GenExample("", "a"),  # an empty prompt starts from eos
        ),
    )
    r = score_task(model.train(), tok, task, batch_size=2, max_new_tokens=6)
    assert r == {"file": "g.jsonl", "examples": 4, "exact_match": 0.5}
    assert model.training  # given back in the mode it came in


def test_diffusion_likelihood_is_llada_estimate_and_exact_on_a_known_model():
    tok = bytes_tokenizer()
    a, b, x, y = (_ids(tok, c) for c in "abxy")
    table = torch.zeros(tok.vocab_size, tok.vocab_size)
    table[a, x] = table[b, y] = 3.0
    model = FirstToken(tok.vocab_size, table, tok.mask_id)
    logp = torch.log_softmax(table, dim=-1)
    pairs = [("a", "xx"), ("a", "yyy"), ("b", "yyy"), ("bq", "x")]
    got = loglikelihoods(model, tok, pairs, diffusion=True, mc_samples=3, batch_size=2)
    # Every masked token of a repeated-token answer costs the same CE: (A / l) * l * CE for any draw.
    exact = [2 * logp[a, x], 3 * logp[a, y], 3 * logp[b, y], logp[b, x]]
    assert got == pytest.approx([float(e) for e in exact], abs=1e-5)
    assert loglikelihoods(model, tok, pairs[:1], diffusion=True, with_greedy=True) == [
        (pytest.approx(got[0], abs=1e-5), False)
    ]
    task = Task("t", Path("t.jsonl"), (Example("a", ("yy", "xx"), 1), Example("b", ("xx", "yy"), 1)))
    r = score_task(model, tok, task, diffusion=True, mask_id=tok.mask_id, mc_samples=2)
    assert r["acc"] == 1.0 and r["acc_norm"] == 1.0
    # Generation: the denoiser fills every position with the first token's favourite.
    gen = Task("g", Path("g.jsonl"), (GenExample("a", "xxxx"), GenExample("b", "xxxx")))
    r = score_task(model, tok, gen, diffusion=True, mask_id=tok.mask_id, max_new_tokens=4)
    assert r["exact_match"] == 0.5


def test_diffusion_likelihood_of_a_llada_model_is_deterministic():
    from gptoughts.models import build_model, model_args
    from gptoughts.models.llada import diffusion_log_likelihood

    tok = bytes_tokenizer()
    torch.manual_seed(0)
    model = build_model("llada", model_args("llada", "debug", {}), device="cpu").eval()
    pairs = [("the capital is", " paris"), ("", "rome"), ("x", "a longer choice")]
    kw = dict(diffusion=True, mask_id=tok.mask_id, mc_samples=4)
    got = loglikelihoods(model, tok, pairs, batch_size=3, **kw)
    assert all(v < 0 for v in got)
    # Each pair has its own seeded draws: the same scores alone, in another order, in other batches.
    assert loglikelihoods(model, tok, pairs[::-1], batch_size=2, **kw) == pytest.approx(got[::-1], abs=1e-5)
    assert loglikelihoods(model, tok, pairs[2:], batch_size=3, **kw) == pytest.approx(got[2:], abs=1e-5)
    # The models' estimator (mean CE per answer token) times the answer length, negated.
    ids = torch.tensor(tok.encode("the capital is paris"))
    nll = diffusion_log_likelihood(
        model, ids, prompt_len=14, n_samples=4, generator=torch.Generator().manual_seed(0)
    )
    assert got[0] == pytest.approx(-6 * float(nll), abs=1e-5)


GOOD = {"context": "the capital of france is", "choices": [" paris", " rome"], "answer": 0}
GEN = {"prompt": "2 + 2 =", "expected": "4", "until": ["\n", "."]}


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
        (
            [GOOD, GEN],
            "line 2 is a generation example but line 1 is multiple-choice; a task file holds one kind",
        ),
        ([GEN, "", GOOD], "line 3 is a multiple-choice example but line 1 is generation"),
        ([{"prompt": "2 + 2 ="}], "line 1 has no 'expected' key"),
        ([{**GEN, "prompt": 4}], "line 1: 'prompt' must be a string"),
        ([{**GEN, "expected": " "}], "line 1: 'expected' is empty"),
        ([{**GEN, "until": "\n"}], "line 1: 'until' must be a non-empty list of stop strings"),
        ([{**GEN, "until": ["\n", ""]}], "line 1: 'until' holds an empty string"),
        (
            [{**GEN, "context": "x"}],
            "line 1 mixes multiple-choice keys (context) with generation keys (prompt",
        ),
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


FACTS = [("france", "paris"), ("italy", "rome"), ("spain", "madrid"), ("japan", "tokyo")]


def _train(corpus: Path, out: Path, steps: int, family: str = "llama") -> None:
    from cli_helpers import FAST

    from gptoughts import cli

    fast = (f"--{k}={v}" for k, v in {**FAST, "model.family": family}.items() if k != "train.sample_prompts")
    argv = ["train", "default", "--data", str(corpus), "--out", str(out), "--max_steps", str(steps)]
    assert cli.main([*argv, "--eval_interval", str(steps), "--lr", "3e-3", *fast]) == 0


@pytest.fixture(scope="module")
def capitals(tmp_path_factory):
    """(run trained on four capitals for 150 steps (~2 s), its corpus, a multiple-choice file asking them),
    shared by the tests of this module that evaluate a real run."""
    d = tmp_path_factory.mktemp("capitals")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPTOUGHTS_CACHE", str(d / "cache"))  # token shards out of the user's home
        corpus = d / "facts.txt"
        corpus.write_text("".join(f"the capital of {c} is {p}.\n" for c, p in FACTS) * 200)
        _train(corpus, d / "run", 150)
        cities = [p for _, p in FACTS]
        rows = [
            {"context": f"the capital of {c} is", "choices": [f" {q}" for q in cities], "answer": i}
            for i, (c, _) in enumerate(FACTS)
        ]
        yield d / "run", corpus, _write(d / "capitals.jsonl", rows)


@pytest.mark.slow
def test_a_run_trained_on_the_answers_scores_above_chance(capitals, capsys):
    from gptoughts import cli

    run, corpus, tasks = capitals
    capsys.readouterr()
    both = ["--data", str(corpus), "--max_batches", "2", "--json"]
    code = cli.main(["eval", str(run), "--tasks", str(tasks), "--device", "cpu", *both])
    out = json.loads(capsys.readouterr().out)  # stdout: one JSON object (preparing --data talks on stderr)
    assert code == 0 and out["loss"] > 0
    res = out["tasks"]["capitals"]
    assert res["examples"] == 4 and res["acc"] >= 0.75 and res["acc_norm"] >= 0.75  # chance: 1/4
    assert json.loads((run / "eval_tasks.json").read_text())["capitals"] == res
    code, text = run_cli(["eval", str(run), "--tasks", str(tasks), "--device", "cpu"], capsys)
    assert code == 0 and "capitals" in text and "acc_norm" in text
    assert text.splitlines()[0].split() == ["task", "examples", "acc", "acc_norm"]  # one run: as before


@pytest.mark.slow
def test_several_runs_are_compared_in_one_table_llama_and_llada(capitals, tmp_path, capsys):
    from gptoughts import cli

    run, corpus, tasks = capitals
    barely = tmp_path / "barely"
    _train(corpus, barely, 2, family="llada")  # masked diffusion: MC likelihood, denoising sampler
    complete = _write(
        tmp_path / "complete.jsonl",
        [{"prompt": f"the capital of {c} is", "expected": f"{p}."} for c, p in FACTS],
    )
    runs = [str(run), str(barely)]
    argv = ["eval", *runs, "--tasks", str(tasks), "--tasks", str(complete), "--device", "cpu"]
    argv += ["--max_new_tokens", "10"]
    capsys.readouterr()
    code = cli.main([*argv, "--data", str(corpus), "--max_batches", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and list(out) == runs
    trained, untrained = out[str(run)], out[str(barely)]
    assert trained["loss"] < untrained["loss"]
    assert trained["tasks"]["capitals"]["acc"] >= 0.75
    assert trained["tasks"]["complete"]["exact_match"] > untrained["tasks"]["complete"]["exact_match"]
    for r in runs:  # each run keeps its own scores
        assert json.loads((Path(r) / "eval_tasks.json").read_text()) == out[r]["tasks"]
    code = cli.main([*argv, "--data", str(corpus), "--max_batches", "2"])
    text = capsys.readouterr().out  # stdout: the table (preparing --data talks on stderr)
    lines = text.strip().splitlines()
    assert code == 0 and lines[0].split() == ["task", "metric", "examples", *runs], text
    assert [line.split()[:2] for line in lines[1:3]] == [["data", "loss"], ["data", "perplexity"]]
    assert lines[1].split()[2:] == [f"{out[r]['loss']:.4f}" for r in runs]
    rows = [line.split()[:3] for line in lines[3:6]]
    assert rows == [["capitals", "acc", "4"], ["capitals", "acc_norm", "4"], ["complete", "exact_match", "4"]]
    assert lines[4].split()[3:] == [f"{out[r]['tasks']['capitals']['acc_norm']:.4f}" for r in runs]
    assert [line.split(":")[0] for line in lines[6:]] == runs  # tokens scored, per run
    # A run that does not exist is refused before any model loads: no run gets rescored.
    (barely / "eval_tasks.json").unlink()
    code, text = run_cli(["eval", str(barely), str(tmp_path / "typo"), "--tasks", str(tasks)], capsys)
    assert code == 2 and "typo does not exist" in text and len(text.strip().splitlines()) == 1, text
    assert not (barely / "eval_tasks.json").exists()


def _yaml(path: Path, data: Path, body: str) -> None:
    """A harness task reading ``data`` (our JSONL) from disk: no download, the harness's own format."""
    path.write_text(
        f"task: {path.stem}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"test_split: test\n{body}"
    )


def test_harness_and_custom_files_give_the_same_accuracy(capitals, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    capitals_run = capitals[0]
    cities = [p for _, p in FACTS]
    mc = _write(
        tmp_path / "capitals_mc.jsonl",
        [
            {"context": f"the capital of {c} is", "choices": [f" {q}" for q in cities], "answer": i}
            for i, (c, _) in enumerate(FACTS)
        ]
        # one the model cannot know: the scores differ from example to example
        + [{"context": "the capital of peru is", "choices": [" lima", " rome"], "answer": 0}],
    )
    gen = _write(
        tmp_path / "capitals_gen.jsonl",
        [{"prompt": f"the capital of {c} is", "expected": p, "until": ["."]} for c, p in FACTS]
        + [{"prompt": "the capital of peru is", "expected": "lima", "until": ["."]}],
    )
    tasks = tmp_path / "harness_tasks"
    tasks.mkdir()
    _yaml(
        tasks / "h_mc.yaml",
        mc,
        'output_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\ntarget_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n",
    )
    _yaml(
        tasks / "h_gen.yaml",
        gen,
        'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{expected}}"\n'
        'generation_kwargs:\n  until: ["."]\n  max_gen_toks: 64\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    regexes_to_ignore: ['^\\s+', '\\s+$']\n",
    )
    from gptoughts import cli

    code = cli.main(
        [
            "eval",
            str(capitals_run),
            "--tasks",
            str(mc),
            "--tasks",
            str(gen),
            "--tasks",
            "h_mc,h_gen",
            "--task_dir",
            str(tasks),
            "--device",
            "cpu",
            "--json",
        ],
    )
    out = capsys.readouterr()  # stdout: the JSON; stderr: the harness's progress bars
    assert code == 0, out.err[-2000:]
    res = json.loads(out.out)["tasks"]
    assert res["h_mc"]["acc"] == pytest.approx(res["capitals_mc"]["acc"])
    assert res["h_mc"]["acc_norm"] == pytest.approx(res["capitals_mc"]["acc_norm"])
    assert res["h_gen"]["exact_match"] == pytest.approx(res["capitals_gen"]["exact_match"])
    assert res["capitals_mc"]["acc"] >= 0.6 and res["capitals_gen"]["exact_match"] >= 0.6  # chance: ~0.2, 0
    assert res["h_mc"]["examples"] == 5 and "acc_stderr" in res["h_mc"]


def test_missing_task_data_is_one_line_before_the_model_loads(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    tasks = tmp_path / "t"
    tasks.mkdir()
    (tasks / "remote.yaml").write_text(
        "task: remote\ndataset_path: nobody/no_such_dataset_here\noutput_type: multiple_choice\n"
        'test_split: test\ndoc_to_text: "{{q}}"\ndoc_to_choice: "{{c}}"\ndoc_to_target: 0\n'
    )
    # The run does not exist: the task data is checked first.
    code, text = run_cli(
        ["eval", str(tmp_path / "no_run"), "--tasks", "remote", "--task_dir", str(tasks)], capsys
    )
    assert code == 2 and "Traceback" not in text, text
    assert len(text.strip().splitlines()) == 1, text
    assert "remote" in text and "--download" in text and "--task_dir" in text
    # A task whose YAML is wrong is not "missing data": the message says to fix the YAML.
    data = _write(tmp_path / "d.jsonl", [GOOD])
    (tasks / "wrong.yaml").write_text(
        f"task: wrong\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
    )
    code, text = run_cli(
        ["eval", str(tmp_path / "no_run"), "--tasks", "wrong", "--task_dir", str(tasks)], capsys
    )
    assert code == 2 and len(text.strip().splitlines()) == 1, text
    assert "could not be built" in text and "'question' is undefined" in text and "--download" not in text


def test_task_entries_split_on_commas_and_names_do_not_collide(tmp_path, capsys):
    from gptoughts.tools.harness import split_specs

    assert split_specs(["hellaswag, a.jsonl", "b.jsonl,arc_easy", "a.jsonl"]) == (
        ["a.jsonl", "b.jsonl"],
        ["hellaswag", "arc_easy"],
    )
    f = _write(tmp_path / "hellaswag.jsonl", [GOOD])
    code, text = run_cli(["eval", str(tmp_path / "no_run"), "--tasks", f"{f},hellaswag"], capsys)
    assert code == 2 and "hellaswag is both a task file's and a harness task's" in text, text


def test_harness_names_without_the_harness_say_how_to_install(monkeypatch, tmp_path, capsys):
    from gptoughts.tools import harness

    monkeypatch.setattr(harness, "_LM", object)
    code, text = run_cli(["eval", str(tmp_path), "--tasks", "hellaswag"], capsys)
    assert code == 2 and "pip install 'gptoughts[eval]'" in text and len(text.strip().splitlines()) == 1


def test_rolling_loglikelihood_covers_every_token_once():
    """The harness's perplexity requests: a text longer than the model's window is scored in disjoint windows;
    with a bigram model the sum must equal the whole text's log-probability after the eos token."""
    pytest.importorskip("lm_eval")
    from gptoughts.tools.harness import NativeLM

    tok = bytes_tokenizer()
    torch.manual_seed(0)
    model = Bigram(tok.vocab_size, torch.randn(tok.vocab_size, tok.vocab_size))
    loaded = SimpleNamespace(model=model, tokenizer=tok, family="llama", args=SimpleNamespace(max_seq_len=8))
    lm = NativeLM(loaded, batch_size=3)
    texts = ["a text of more than eight tokens, scored in windows", "short"]
    got = lm.loglikelihood_rolling([SimpleNamespace(args=(t,)) for t in texts])
    for text, score in zip(texts, got, strict=True):
        ids = [tok.eos_id, *tok.encode(text)]
        logp = torch.log_softmax(model(torch.tensor([ids]))[0].detach(), dim=-1)
        expected = sum(float(logp[t - 1, ids[t]]) for t in range(1, len(ids)))
        assert score == pytest.approx(expected, abs=1e-3), text


def test_eval_refuses_out_of_range_flags_and_keeps_earlier_scores(capitals, tmp_path, capsys):
    run, corpus, tasks = capitals
    code, text = run_cli(["eval", str(run), "--data", str(corpus), "--max_batches", "0"], capsys)
    assert code == 2 and "--max_batches must be >= 1" in text
    code, text = run_cli(["eval", str(run), "--data", str(corpus), "--block_size", "100000"], capsys)
    assert code == 2 and "longer than the model's" in text and len(text.strip().splitlines()) == 1
    other = _write(tmp_path / "other.jsonl", [GOOD])
    for f in (tasks, other):  # two evaluations on different files: RUN/eval_tasks.json holds both
        assert run_cli(["eval", str(run), "--tasks", str(f), "--device", "cpu"], capsys)[0] == 0
    assert {"capitals", "other"} <= set(json.loads((run / "eval_tasks.json").read_text()))


def test_harness_rows_count_a_groups_examples_from_its_tasks():
    """lm-eval reports example counts for leaf tasks only: a group (mmlu) gets its subtasks' sum, so its row is
    kept when ranks' slices combine and in the several-runs table."""
    pytest.importorskip("lm_eval")
    from gptoughts.tools.harness import _results

    out = {
        "results": {
            "grp": {"alias": "grp", "acc,none": 0.5, "acc_stderr,none": 0.1},
            "a": {"alias": " - a", "acc,none": 0.25, "sample_len": 4},
            "b": {"alias": " - b", "acc,none": 0.75, "exact_match,strict": 1.0},
        },
        "n-samples": {"a": {"original": 10, "effective": 4}, "b": {"original": 4, "effective": 4}},
        "group_subtasks": {"grp": ["a", "b"]},
    }
    rows = _results(out)
    assert rows["grp"] == {"examples": 8, "acc": 0.5, "acc_stderr": 0.1}
    assert rows["a"] == {"examples": 4, "acc": 0.25}
    assert rows["b"] == {"examples": 4, "acc": 0.75, "exact_match[strict]": 1.0}


def test_generation_stops_once_every_row_holds_a_stop_string():
    """A model that never emits eos: rows stop at the sampler's first check after their stop string (every
    STOP_EVERY tokens), not at max_new_tokens; the text is the same."""
    from gptoughts.sampling import STOP_EVERY

    tok = bytes_tokenizer()
    table = torch.zeros(tok.vocab_size, tok.vocab_size)
    for prev, nxt in (("a", "b"), ("b", "\n"), ("\n", "a")):  # a b \n a b \n ... forever
        table[_ids(tok, prev), _ids(tok, nxt)] = 5.0
    model = Bigram(tok.vocab_size, table, max_seq_len=128)
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    got = generate_until(model, tok, ["xa", "ya"], until=["\n"], max_new_tokens=60, batch_size=2)
    assert got == ["b", "b"]
    assert len(calls) == STOP_EVERY  # was 60: one forward per token to the limit


def test_the_harness_caches_in_the_sessions_own_hugging_face_home(tmp_path_factory):
    # `datasets` (the harness's loader of local task files) caches under ~/.cache/huggingface by default: a test
    # run must neither write there nor read back what another run left.
    config = pytest.importorskip("datasets.config")
    base = tmp_path_factory.getbasetemp().resolve()
    assert Path(config.HF_DATASETS_CACHE).resolve().is_relative_to(base)
