"""The path a user types: what is asked for is what is built, it is said before it starts, and the defects a
newcomer met (issue 10) stay fixed. Through the CLI as typed, wherever the defect was met there."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import FASTRUN, ok, plan_of, run_cli

import gptoughts
from gptoughts import cli, models
from gptoughts.cli import options as cli_options
from gptoughts.config import load_config, size_defaults
from gptoughts.errors import ConfigError

PNG = b"\x89PNG\r\n\x1a\n"


_run, _ok, _plan = run_cli, ok, plan_of


# ------------------------------------------------------------------------------------- what is built


@pytest.mark.parametrize("family, size", [(f, s) for f in models.FAMILIES for s in models.list_sizes(f)])
def test_data_and_size_build_that_size(family, size, text_corpus, cache_dir):
    """`train --data X --model F --size S` builds S: the size preset's shape, its parameter count at the vocab
    the size trains with (counted on the meta device through a dry run), nothing of the quickstart."""
    model, _, hist = gptoughts.train(
        data_path=str(text_corpus), model=family, size=size, dry_run=True, **{"perf.device": "cpu"}
    )
    preset = models.model_args(family, size)
    assert (model.args.d_model, model.args.n_layers) == (preset.d_model, preset.n_layers)
    tok = size_defaults(family, size).get("data", {}).get("tokenizer", "bpe:8192")
    vocab = -(-int(tok.split(":")[1]) // 64) * 64
    expected = models.build_model(
        family, models.model_args(family, size, {"vocab_size": vocab}), device="meta"
    )
    assert hist.plan["params"] == expected.num_params() == model.num_params()
    assert hist.plan["model"] == f"{family}/{size}" and hist.plan["corpus"]["cut"] is False
    assert not Path(hist.run_dir).exists() and not cache_dir.exists()  # a dry run writes nothing at all
    # nor points torch.compile's caches into it (in a fresh process, importing dynamo would create the folder)
    assert str(cache_dir) not in os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")


def test_size_1b_from_the_command_line_is_the_1b_shape(text_corpus, cache_dir, capsys):
    text = _ok(["train", "--data", str(text_corpus), "--size", "1b", "--dry_run"], capsys)
    assert _plan(text) == ("llama", "1b", 1_107_363_840)
    assert "block 2,048" in text and "runs/llama-1b" in text
    cfg = load_config(None, {"data.sources": ["x"], "model.size": "1b"})
    assert cfg.data.max_bytes is None and cfg.train.max_steps is None and cfg.train.learning_rate == 3e-4
    assert cfg.eval.sample_prompts is None and cfg.model.overrides == {}  # the data's own (below)


def test_bare_train_is_the_quickstart_and_says_so(capsys, cache_dir):
    text = _ok(["train", "--dry_run"], capsys)
    family, size, params = _plan(text)
    assert (family, size) == ("llama", "debug") and 10_000_000 < params < 10_200_000
    assert "the preset's max_steps 250" in text and "data.max_bytes = 6,000,000" in text
    assert "runs/quickstart" in text


@pytest.mark.slow
def test_a_12mb_corpus_is_read_whole(tmp_path, cache_dir, capsys):
    import sysconfig

    corpus = tmp_path / "big"
    corpus.mkdir()
    total = 0
    std = Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(std.rglob("*.py")):
        if "site-packages" in f.parts or "__pycache__" in f.parts:
            continue
        data = f.read_bytes()
        if b"\0" in data[:8192]:
            continue
        (corpus / "_".join(f.relative_to(std).parts)).write_bytes(data)
        total += len(data)
        if total > 12_000_000:
            break
    assert total > 12_000_000
    out = tmp_path / "run"
    _ok(
        [
            "train",
            "--data",
            str(corpus),
            "--tokenizer",
            "bytes",
            "--out",
            str(out),
            "--max_steps",
            "1",
            *FASTRUN,
        ],
        capsys,
    )
    plan = json.loads((out / "run.json").read_text())["plan"]
    assert plan["corpus"]["cut"] is False and plan["corpus"]["bytes_read"] == plan["corpus"]["bytes"] == total


@pytest.mark.plots
@pytest.mark.slow
def test_plan_counts_equal_what_the_run_reports(text_corpus, cache_dir, tmp_path, capsys):
    out = tmp_path / "run"
    text = _ok(
        [
            "train",
            "--data",
            str(text_corpus),
            "--tokenizer",
            "bytes",
            "--out",
            str(out),
            "--epochs",
            "0.05",
            *FASTRUN,
        ],
        capsys,
    )
    run = json.loads((out / "run.json").read_text())
    plan = run["plan"]
    manifest = json.loads((Path(run["data"]) / "manifest.json").read_text())
    assert plan["corpus"]["tokens"] == manifest["totals"]["train_tokens"]
    assert plan["params"] == run["params"] == _plan(text)[2]
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert steps[-1] == plan["batch"]["total_steps"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps[-1] and summary["tokens"] == steps[-1] * plan["batch"]["tokens_per_step"]
    assert summary["best_val_loss"] is not None and "done" in text and "next: gptoughts sample" in text
    for png in ("overview.png", "loss.png", "lr.png"):  # plots after a debug run: valid PNG files
        data = (out / "plots" / png).read_bytes()
        assert data[:8] == PNG and len(data) > 2000


@pytest.mark.slow
def test_the_plan_says_fp8_and_warns_of_fp8_switches_in_a_run_without_it(
    text_corpus, cache_dir, tmp_path, capsys
):
    from gptoughts.training.plan import RunPlan

    out = tmp_path / "run"
    argv = [
        "train",
        "--data",
        str(text_corpus),
        "--tokenizer",
        "bytes",
        "--out",
        str(out),
        "--max_steps",
        "1",
    ]
    text = _ok([*argv, "--perf.fp8_fast_accum", "true", *FASTRUN], capsys)
    warning = "perf.fp8_fast_accum acts on fp8 matmuls, but this run's matmuls are not fp8 (--fp8 is off)"
    assert warning in text
    plan = json.loads((out / "run.json").read_text())["plan"]
    assert any(w.startswith(warning) for w in plan["warnings"])
    assert "  fp8:" not in RunPlan(**plan).format()
    # a run whose linears are fp8 (a GPU's): the plan says how many, and the fast accumulation
    on = {**plan["resolved"], "fp8": "tensorwise (asked)", "fp8_linears": "14", "fp8_fast_accum": "True"}
    shown = RunPlan(**{**plan, "resolved": on, "warnings": []}).format()
    assert (
        "  fp8: tensorwise (asked), 14 linear layers; fast accumulation in the backward matmuls too" in shown
    )


def test_dry_run_of_an_uncached_corpus_estimates_and_writes_nothing(text_corpus, cache_dir, tmp_path, capsys):
    out = tmp_path / "never"
    text = _ok(
        ["train", "--data", str(text_corpus), "--size", "125m", "--out", str(out), "--dry_run"], capsys
    )
    assert "estimated: not tokenized yet" in text and not out.exists() and not cache_dir.exists()
    assert "warning: the corpus" in text  # 60 KB of text for a 135M model


# ------------------------------------------------------------------------------------------- stopping rules


def test_the_stopping_rule_given_wins_and_two_are_an_error(text_corpus, capsys):
    assert load_config(None, {"train.epochs": "2"}).train.max_steps is None  # the quickstart's 250 steps go
    cfg = load_config("quickstart", {"train.max_tokens": "1e5"})
    assert cfg.train.max_tokens == 100_000 and cfg.train.max_steps is None
    with pytest.raises(ConfigError, match="two stopping rules"):
        load_config(None, {"train.epochs": 1, "train.max_steps": 5})
    code, text = _run(["train", "--epochs", "1", "--max_steps", "5"], capsys)
    assert code == 2 and "two stopping rules" in text and "Traceback" not in text
    assert load_config(None, {"data.sources": ["x"], "train.epochs": 3}).train.epochs == 3.0  # API num_epochs


def test_two_stopping_rules_in_a_toml_file_are_an_error_unless_a_flag_gives_one(tmp_path, capsys):
    f = tmp_path / "run.toml"
    f.write_text("[train]\nmax_steps = 3\nepochs = 1.0\n")
    code, text = _run(["train", str(f), "--dry_run"], capsys)
    assert code == 2 and "two stopping rules" in text and "run.toml" in text and "Traceback" not in text
    assert load_config(f, {"train.max_tokens": 4096}).train.max_tokens == 4096  # the flag replaces the file's


# -------------------------------------------------------------------------------------------- the defects


@pytest.mark.slow
def test_generate_is_the_function_twice_in_a_fresh_process(tmp_path, text_corpus, cache_dir):
    code = f"""
import gptoughts
m, t, h = gptoughts.train(data_path={str(text_corpus)!r}, size="debug", save_dir={str(tmp_path / "r")!r},
                          device="cpu", max_steps=2, **{{"data.tokenizer": "bytes", "train.block_size": 32,
                          "run.progress": False, "run.tensorboard": False, "perf.threads": 1}})
loaded = gptoughts.load({str(tmp_path / "r")!r})
a = gptoughts.generate(loaded, "def ", max_new_tokens=3, seed=1)
b = gptoughts.generate(loaded, "def ", max_new_tokens=3, seed=1)
assert a == b and a.startswith("def "), (a, b)
print("OK")
"""
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "GPTOUGHTS_CACHE": str(cache_dir)},
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-2000:]


@pytest.mark.slow
def test_resume_auto_takes_the_runs_own_config(text_corpus, cache_dir, tmp_path, capsys):
    out = tmp_path / "run"
    _ok(
        [
            "train",
            "--data",
            str(text_corpus),
            "--tokenizer",
            "bytes",
            "--out",
            str(out),
            "--max_steps",
            "2",
            "--save_interval",
            "2",
            *FASTRUN,
        ],
        capsys,
    )
    text = _ok(["train", "--resume", "auto", "--out", str(out), "--max_steps", "4", "--no_progress"], capsys)
    assert "resumed from" in text and "corpus: 10 file(s)" in text  # its own data, not the stdlib
    cfg = load_config(None, {"run.resume": "auto", "run.out": str(out)})
    assert (
        cfg.data.tokenizer == "bytes" and cfg.train.block_size == 32 and cfg.train.max_steps == 4
    )  # as extended
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert steps == sorted(set(steps)) and steps[-1] == 4


@pytest.mark.slow
def test_eval_scores_all_of_the_corpus(text_corpus, cache_dir, tmp_path, capsys):
    out = tmp_path / "run"
    _ok(
        [
            "train",
            "--data",
            str(text_corpus),
            "--tokenizer",
            "bytes",
            "--out",
            str(out),
            "--max_steps",
            "1",
            *FASTRUN,
        ],
        capsys,
    )
    capsys.readouterr()
    assert cli.main(["eval", str(out), "--data", str(text_corpus), "--json", "--batch_size", "4"]) == 0
    res = json.loads(capsys.readouterr().out)
    corpus_bytes = sum(f.stat().st_size for f in text_corpus.iterdir())
    # bytes tokenizer: ~1 token a byte, all scored but each window's first and each file's short tail
    assert "in windows of" in res["scored"] and res["tokens"] > 0.9 * corpus_bytes
    assert (
        cli.main(
            [
                "eval",
                str(out),
                "--data",
                str(text_corpus),
                "--json",
                "--max_batches",
                "2",
                "--batch_size",
                "4",
            ]
        )
        == 0
    )
    part = json.loads(capsys.readouterr().out)
    assert part["tokens"] == 2 * 4 * 32 and "of its" in part["scored"]


def test_wandb_without_a_key_logs_offline_and_a_failure_costs_one_line(monkeypatch, tmp_path, capsys):
    from gptoughts.training import metrics

    calls = []

    class FakeWandb:
        @staticmethod
        def init(**kw):
            calls.append(kw)
            if kw.get("mode") == "broken":
                raise RuntimeError("network unreachable\nmore")
            return object()

    monkeypatch.setitem(sys.modules, "wandb", FakeWandb)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    assert metrics._start_wandb(tmp_path, "p", {}) is not None and calls[-1]["mode"] == "offline"
    assert "logging offline" in capsys.readouterr().out
    monkeypatch.setenv("WANDB_MODE", "broken")
    assert metrics._start_wandb(tmp_path, "p", {}) is None
    assert "training without it" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: refused before anything is written
    code, text = _run(["train", "--data", str(tmp_path), "--out", str(tmp_path / "w"), "--wandb"], capsys)
    assert code == 2 and "pip install" in text and not (tmp_path / "w").exists()


@pytest.mark.parametrize(
    "typo",
    [
        "--auto-batchh",
        "--versionn",
        "--weight_decai",
        "--schedul",
        "--num_epoch",
        "--run.lrate",
        "--train.max_step",
        "--text_fild",
        "--extension",
        "--lr_rate",
    ],
)
def test_every_option_the_cli_suggests_is_one_it_accepts(typo, capsys):
    code, text = _run(["train", typo, "1"], capsys)
    assert code == 2 and "unknown option" in text and "needs a value" not in text, text
    suggested = re.findall(r"did you mean (--[\w.]+)\?", text)
    for s in suggested:  # each parses (a flag takes no value), or this raises
        name = s[2:].replace("-", "_")
        cli_options.parse_overrides(
            [s] if name in cli_options.FLAGS or name in cli_options.TRAIN_SWITCHES else [s, "1"]
        )
    assert suggested or "--help" in text


def test_version_help_and_bare_command(capsys):
    code, text = _run(["--version"], capsys)
    assert code == 0 and text.strip() == f"gptoughts {gptoughts.__version__}"
    code, text = _run([], capsys)
    assert code == 0 and "commands:" in text and "train" in text
    code, text = _run(["train", "--help"], capsys)
    assert code == 0 and "Where a run starts" in text
    for family in models.FAMILIES:
        assert f"  {family}" in text and ", ".join(models.list_sizes(family)) in text
    assert "--weight_decay  (float, default 0.1)" in text and "--nan_policy" in text and "--threads" in text
    code, text = _run(["config", "--size", "125m", "--data", "x.txt"], capsys)
    assert code == 0 and 'size = "125m"' in text and "block_size = 2048" in text and "max_bytes" not in text


def test_the_seeds_spellings_are_aliases():
    _, o, _ = cli_options.parse_overrides(
        [
            "--model_type",
            "llada",
            "--use_fp8",
            "--recover-nan",
            "--compile",
            "--block_size",
            "64",
            "--batch_size",
            "2",
            "--num_epochs",
            "3",
            "--save_dir",
            "x",
            "--threads",
            "2",
            "--weight_decay",
            "0.05",
        ]
    )
    assert o == {
        "model.family": "llada",
        "perf.fp8": True,
        "train.batch_size": "2",
        "recovery.nan_policy": "rollback",
        "perf.compile": True,
        "train.block_size": "64",
        "train.epochs": "3",
        "run.out": "x",
        "perf.threads": "2",
        "train.weight_decay": "0.05",
    }
    cfg = load_config(None, {**o, "data.sources": ["x"]})
    assert (cfg.model.family, cfg.perf.fp8, cfg.recovery.nan_policy, cfg.train.epochs) == (
        "llada",
        True,
        "rollback",
        3.0,
    )


def test_seeds_auto_batch_flag_sets_auto():
    _, o, _ = cli_options.parse_overrides(["--auto-batch", "--recover-nan"])
    assert o == {"train.batch_size": "auto", "recovery.nan_policy": "rollback"}


def test_tune_writes_a_config_without_the_quickstarts_out(tmp_path):
    from gptoughts.tools.tune import Trial, write_winner

    cfg = load_config("default", {"data.sources": ["x"]})
    path = write_winner(
        Trial({"perf.activation_checkpointing": "none"}, 1.0, None, None), cfg, tmp_path / "t.toml"
    )
    text = path.read_text()
    assert "quickstart" not in text and "\nout =" not in text
    assert load_config(str(path), {}).run.out == "runs/llama-debug"


@pytest.mark.slow
def test_curriculum_paths_are_relative_to_the_toml_and_phases_are_announced(
    tmp_path, text_corpus, cache_dir, capsys, monkeypatch
):
    conf = tmp_path / "conf"
    (conf / "a").mkdir(parents=True)
    (conf / "b").mkdir()
    files = sorted(text_corpus.iterdir())
    for f in files[:5]:
        (conf / "a" / f.name).write_text(f.read_text())
    for f in files[5:]:
        (conf / "b" / f.name).write_text(f.read_text())
    (conf / "run.toml").write_text(
        'base = "default"\n[data]\nsources = ["a", "b"]\ntokenizer = "bytes"\n'
        '[[data.phases]]\nname = "first"\nsources = ["a"]\ntokens = 256\n'
        '[[data.phases]]\nname = "second"\nsources = ["b"]\n'
    )
    monkeypatch.chdir(tmp_path)  # not the TOML's folder
    text = _ok(
        ["train", "conf/run.toml", "--out", "r", "--max_steps", "5", "--log_interval", "1", *FASTRUN], capsys
    )
    # 256 tokens of 'first' are steps 1-4 of 2 x 32 tokens: the fifth step's batch is the first of 'second'
    assert "step 5: curriculum phase 'second' begins (after 'first')" in text


def test_bench_headline_and_breakdown_agree():
    from gptoughts.tools.bench import run_bench

    r = run_bench(
        load_config(
            "default",
            {"perf.device": "cpu", "train.block_size": 32, "train.batch_size": 2, "perf.threads": 1},
        ),
        steps=3,
        warmup=1,
    )
    parts = sum(r["breakdown"][f"time/{k}_ms"] for k in ("data", "forward", "backward", "optimizer", "other"))
    assert parts == pytest.approx(r["step_ms"], rel=1e-6)
    assert r["tokens_per_s"] == pytest.approx(2 * 32 / (r["step_ms"] / 1e3), rel=1e-6)


@pytest.mark.slow
def test_progress_line_has_an_eta_and_threads_are_measured_or_given(
    text_corpus, cache_dir, tmp_path, capsys, monkeypatch
):
    from gptoughts.perf import hardware

    shown = [a for a in FASTRUN if a != "--no_progress"]  # the progress lines (not a terminal: plain lines)
    text = _ok(
        [
            "train",
            "--data",
            str(text_corpus),
            "--tokenizer",
            "bytes",
            "--out",
            str(tmp_path / "a"),
            "--max_steps",
            "4",
            "--log_interval",
            "2",
            *shown,
        ],
        capsys,
    )
    assert re.search(r"step 2/4 loss [\d.]+ lr \S+ [\d,]+ tok/s eta 0:00:\d\d", text), text
    assert json.loads((tmp_path / "a" / "run.json").read_text())["resolved"]["threads"] == "1 (--threads)"
    slow = {"n": 0}

    def step() -> None:  # slow whenever more than one thread is in use: the probe must keep one
        slow["n"] += 1
        if torch.get_num_threads() > 1:
            import time

            time.sleep(0.02)

    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    n, why, step_s = hardware.measure_cpu_threads(step)
    # an untimed first step, then each count once: 1 thread clearly faster, no second round
    assert (n, torch.get_num_threads(), slow["n"]) == (1, 1, 3) and why.startswith("measured")
    assert step_s < 0.02  # the chosen count's own step time (the run's speed estimate is made from it)


def test_finetune_override_is_checked_against_the_folders_family(tmp_path, cache_dir):
    sys.path.insert(0, str(Path(__file__).parent / "finetune"))
    transformers = pytest.importorskip("transformers")
    from hf_helpers import make_tokenizer

    folder = tmp_path / "ds"
    transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            vocab_size=320,
            max_position_embeddings=128,
        )
    ).save_pretrained(str(folder))
    make_tokenizer().save(folder)
    cfg = load_config("finetune", {"model.init_from": str(folder), "model.bias_update_rate": "0"})
    assert cfg.model.family == "deepseek" and cfg.model.overrides == {"bias_update_rate": 0.0}
    with pytest.raises(ConfigError, match="n_layer"):  # checked against deepseek's fields, not llama's
        load_config("finetune", {"model.init_from": str(folder), "model.n_layer": 3})
    corpus = tmp_path / "notes.txt"
    corpus.write_text("some text to continue pretraining on. " * 400)
    code = cli.main(
        [
            "finetune",
            "--model",
            str(folder),
            "--data",
            str(corpus),
            "--model.bias_update_rate",
            "0",
            "--out",
            str(tmp_path / "ft"),
            "--max_steps",
            "1",
            *FASTRUN,
        ]
    )
    assert (
        code == 0
        and json.loads((tmp_path / "ft" / "run.json").read_text())["args"]["bias_update_rate"] == 0.0
    )


@pytest.mark.slow
def test_an_fsdp_run_resumed_on_one_process_keeps_its_global_batch(text_corpus, cache_dir, tmp_path, capsys):
    """Saved by 2 FSDP ranks with batch 2 (4 rows a step), resumed alone: accumulation 2 keeps 4 rows a step."""
    import os

    out = tmp_path / "run"
    args = [
        "--data",
        str(text_corpus),
        "--out",
        str(out),
        "--max_steps",
        "2",
        "--save_interval",
        "2",
        "--parallel.strategy",
        "fsdp",
        *[a for a in FASTRUN if a not in ("--threads", "1")],
    ]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "gptoughts",
            "train",
            *args,
            "--tokenizer",
            "bytes",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "GPTOUGHTS_CACHE": str(cache_dir)},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    saved = json.loads((out / "run.json").read_text())["plan"]["batch"]
    assert saved["world_size"] == 2 and saved["tokens_per_step"] == 2 * 2 * 32
    text = _ok(["train", "--resume", "auto", "--out", str(out), "--max_steps", "3", "--no_progress"], capsys)
    plan = json.loads((out / "run.json").read_text())["plan"]["batch"]
    assert (
        plan["world_size"] == 1
        and plan["grad_accum"] == 2
        and plan["tokens_per_step"] == saved["tokens_per_step"]
    )
    assert "keeps the resumed run's global batch" in json.dumps(plan["why"]) and "resumed from" in text


def test_samples_continue_the_corpus_unless_prompts_are_given(tmp_path, cache_dir, capsys):
    """A newcomer's finding: samples were prompted with Python code whatever the corpus. Unset, the prompt is the
    corpus's first words; given, it is used as given."""
    story = tmp_path / "story.txt"
    story.write_text("Once upon a time there was a small red fox.\nIt lived by the river.\n" * 200)
    # Text without spaces is one long word: the prompt is cut to 32 tokens (whole characters), and samples run.
    cjk = tmp_path / "cjk.txt"
    cjk.write_text(
        "むかしむかしあるところにおじいさんとおばあさんがすんでいました。\n" * 200, encoding="utf-8"
    )

    def sample(
        corpus: Path, out: str, *flags: str
    ) -> str:  # the summary's: the first prompt, then the model's
        argv = ["train", "--data", str(corpus), "--size", "debug", "--tokenizer", "bytes", "--max_steps", "2"]
        _ok([*argv, *FASTRUN, "--out", str(tmp_path / out), *flags], capsys)
        return json.loads((tmp_path / out / "summary.json").read_text())["sample"]

    assert sample(story, "auto").startswith("Once upon a time there was")
    assert sample(story, "given", "--sample_prompts", "It lived").startswith("It lived")
    assert sample(cjk, "cjk").startswith("むかしむかしあるとこ")  # 32 bytes: ten whole characters


def test_the_python_api_names_a_misspelt_keyword_as_the_cli_does():
    import gptoughts

    with pytest.raises(ConfigError, match=r"unknown argument `max_step` \(did you mean `max_steps`\?\)"):
        gptoughts.train(dry_run=True, max_step=3)
    # a setting by its bare name is taken, as the command line takes it
    _, _, history = gptoughts.train(dry_run=True, warmup_steps=3, max_steps=8)
    assert history.plan["batch"]["warmup_steps"] == 3
    with pytest.raises(ConfigError, match=r"`warmup_step` \(did you mean \*\*\{'train.warmup_steps'"):
        gptoughts.train(dry_run=True, warmup_step=3)
    with pytest.raises(ConfigError, match=r"`lora` is an argument of gptoughts.finetune"):
        gptoughts.train(dry_run=True, lora=True)
