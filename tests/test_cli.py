"""The command line: every subcommand of the foundation, and a one-line error for each bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import refused_leaving

from gptoughts import cli


def _args(fast: dict) -> list[str]:
    return [f"--{k}={v}" for k, v in fast.items() if k != "train.sample_prompts"]


def _run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def trained(tmp_path_factory, fast, cache_dir):
    """One tiny run shared by the sample/eval tests."""
    import sysconfig

    root = tmp_path_factory.mktemp("trained")
    corpus = root / "corpus.py"
    corpus.write_text((Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text())
    out = root / "run"
    assert (
        cli.main(
            [
                "train",
                "default",
                "--data",
                str(corpus),
                "--out",
                str(out),
                "--max_steps",
                "3",
                "--eval_interval",
                "3",
                *_args(fast),
            ]
        )
        == 0
    )
    return out, corpus


def test_sample_eval_env_prepare(trained, tmp_path, capsys):
    run, corpus = trained
    code, out, _ = _run_cli(
        ["sample", str(run), "--prompt", "def ", "--max_new_tokens", "5", "--seed", "1"], capsys
    )
    assert code == 0 and out.startswith("def ")
    code, out, _ = _run_cli(
        [
            "eval",
            str(run),
            "--data",
            str(corpus),
            "--json",
            "--batch_size",
            "2",
            "--block_size",
            "32",
            "--max_batches",
            "2",
        ],
        capsys,
    )
    res = json.loads(out)
    assert code == 0 and res["loss"] > 0 and res["perplexity"] > 1
    code, out, _ = _run_cli(["env", "--json"], capsys)
    env = json.loads(out)
    assert code == 0 and {"device", "bf16", "fp16", "fp8", "compile", "recommended"} <= set(env)
    code, out, _ = _run_cli(
        ["prepare", "--data", str(corpus), "--out", str(tmp_path / "shards"), "--tokenizer", "bytes"], capsys
    )
    assert code == 0 and (tmp_path / "shards" / "manifest.json").exists() and "train tokens" in out
    # --workers (data.workers): the same bytes with one tokenizing process; 0 is one line
    one = tmp_path / "one"
    code, out, _ = _run_cli(
        ["prepare", "--data", str(corpus), "--out", str(one), "--tokenizer", "bytes", "--workers", "1"],
        capsys,
    )
    assert code == 0
    for f in (tmp_path / "shards").glob("*.bin"):
        assert (one / f.name).read_bytes() == f.read_bytes()
    code, _, err = _run_cli(
        [
            "prepare",
            "--data",
            str(corpus),
            "--out",
            str(tmp_path / "no"),
            "--tokenizer",
            "bytes",
            "--workers",
            "0",
        ],
        capsys,
    )
    assert (
        code == 2 and "workers must be a number of processes >= 1" in err and not (tmp_path / "no").exists()
    )


def test_interactive_asks_the_four_questions(tmp_path, text_corpus, cache_dir, fast, monkeypatch, capsys):
    answers = iter(["debug", str(text_corpus), "0.02", "2"])
    asked = []

    def fake_input(prompt: str) -> str:
        asked.append(prompt)
        return next(answers)

    monkeypatch.setattr("builtins.input", fake_input)
    code = cli.main(["train", "default", "--interactive", "--out", str(tmp_path / "i"), *_args(fast)])
    assert code == 0 and len(asked) == 4
    assert "size" in asked[0].lower() and "corpus" in asked[1].lower() and "epoch" in asked[2].lower()
    assert (tmp_path / "i" / "checkpoints").exists()


BAD_INPUTS = {
    "missing path": (["--data", "{tmp}/nope.txt"], "does not exist"),
    "empty corpus": (["--data", "{empty}"], "empty"),
    "only binary files": (["--data", "{binary}"], "binary"),
    "unknown key": (["--train.max_step", "3", "--data", "{corpus}"], "max_steps"),
    "unknown option": (["--max_step", "3", "--data", "{corpus}"], "max_steps"),
    "wrong type": (["--max_steps", "many", "--data", "{corpus}"], "integer"),
    "smaller than one block": (["--data", "{tiny}", "--block_size", "512"], "block"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_a_one_line_error(case, tmp_path, text_corpus, cache_dir, fast, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "a.txt").write_bytes(b"\x00\x01\x02" * 100)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("x = 1\n")
    extra, expected = BAD_INPUTS[case]
    extra = [a.format(tmp=tmp_path, empty=empty, binary=binary, corpus=text_corpus, tiny=tiny) for a in extra]
    code, _, err = _run_cli(
        ["train", "default", "--out", str(tmp_path / "run"), *_args(fast), *extra], capsys
    )
    assert code == 2
    # Progress/INFO lines may precede it; the error itself is exactly one line.
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]), err
    assert expected in errors[0].lower(), errors[0]
    assert "Traceback" not in err


def test_binary_files_skipped_and_invalid_utf8_replaced(tmp_path, text_corpus, cache_dir, fast, capsys):
    (text_corpus / "blob.txt").write_bytes(b"\x00\xff\x00" * 50)
    (text_corpus / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1") * 50)
    code = cli.main(
        [
            "train",
            "default",
            "--data",
            str(text_corpus),
            "--out",
            str(tmp_path / "r"),
            "--max_steps",
            "1",
            *_args(fast),
        ]
    )
    assert code == 0
    manifest = json.loads(next((cache_dir / "datasets").glob("*/manifest.json")).read_text())
    text = json.dumps(manifest)
    assert '"skipped_binary": 1' in text
    assert '"invalid_utf8_files": 1' in text


@pytest.mark.slow
def test_existing_run_is_never_clobbered(tmp_path, text_corpus, cache_dir, fast, capsys):
    out = tmp_path / "run"
    base = [
        "train",
        "default",
        "--data",
        str(text_corpus),
        "--out",
        str(out),
        "--max_steps",
        "2",
        *_args(fast),
    ]
    assert cli.main(base) == 0
    # Same dir, no --resume / --overwrite: refused, nothing touched.
    refused_leaving(out, base, capsys, "--resume", "--overwrite")
    # A different model into the same dir with --resume: refused, nothing touched.
    refused_leaving(out, [*base, "--resume", "--model.n_layers", "3"], capsys)
    # A non-empty dir that is not a run: refused, nothing touched.
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    refused_leaving(
        other, ["train", "default", "--data", str(text_corpus), "--out", str(other), *_args(fast)], capsys
    )
    # --overwrite replaces it.
    assert cli.main([*base, "--overwrite"]) == 0


def test_unknown_command_and_help(capsys):
    assert cli.main(["trian"]) == 2
    assert "train" in capsys.readouterr().err
    assert cli.main(["train", "--help"]) == 0
    assert "--batch_size" in capsys.readouterr().out
    assert cli.main(["--help"]) == 0


@pytest.mark.slow
def test_console_script_entry_point_runs(tmp_path):
    """`python -m gptoughts` is the same program as the `gptoughts` console script; its help piped into a
    reader that stops early (`| head -1`) ends quietly, without a BrokenPipeError traceback."""
    r = subprocess.run(
        [sys.executable, "-m", "gptoughts", "env"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert r.returncode == 0 and "device" in r.stdout
    closed = "import os, sys; r, w = os.pipe(); os.close(r); os.dup2(w, 1); from gptoughts import cli; "
    r = subprocess.run(  # stdout is a pipe whose reader has gone
        [sys.executable, "-c", closed + "sys.exit(cli.main(['train', '--help']))"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow
def test_wandb_offline(tmp_path, text_corpus, cache_dir, fast, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "w"
    assert (
        cli.main(
            [
                "train",
                "default",
                "--data",
                str(text_corpus),
                "--out",
                str(out),
                "--max_steps",
                "2",
                "--log_interval",
                "1",
                "--wandb",
                *_args(fast),
            ]
        )
        == 0
    )
    assert list((out / "wandb").glob("offline-run-*"))


@pytest.mark.slow
def test_version_and_help_do_not_import_torch_and_the_api_stays_callable():
    """The package imports its API on first use: `gptoughts --version` / `--help` start without torch; importing a
    subpackage (gptoughts.training.build: the package is not named train) leaves gptoughts.train the function."""
    import subprocess
    import sys

    for flag in ("--version", "--help"):
        code = f"import sys, runpy; sys.argv = ['gptoughts', '{flag}']\n"
        code += "try:\n    runpy.run_module('gptoughts', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        code += "assert 'torch' not in sys.modules, 'torch imported'"
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    code = (
        "import gptoughts.training.build, gptoughts; from gptoughts import train, generate; "
        "assert callable(gptoughts.train) and train is gptoughts.train and generate.__name__ == 'generate_text'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_command_that_trains_nothing_leaves_no_startup_clock_behind(monkeypatch):
    """The CLI starts the start-up clock at its command; a command that never trains (here --version) must not
    leave that origin for a later API call in the same process, whose start-up would then count from it (a test's
    API run read 1.4 s of "imports" left by an earlier test's CLI call)."""
    from gptoughts.perf import startup

    monkeypatch.setattr(startup, "_commands", 0)  # the first command of a process counts from its start (0.0)
    assert cli.main(["--version"]) == 0
    before = startup.process_age_s()
    assert startup.startup_clock() >= before


def test_log_lines_to_a_file_or_pipe_are_one_line_each(tmp_path, text_corpus, cache_dir):
    """Piped or redirected, rich wrapped each log record at 80 columns and padded it with spaces."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gptoughts",
            "prepare",
            "--data",
            str(text_corpus),
            "--out",
            str(tmp_path / "s"),
            "--tokenizer",
            "bytes",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        env={**os.environ, "GPTOUGHTS_CACHE": str(cache_dir), "PYTHONPATH": str(Path(__file__).parents[1])},
        check=True,
    )
    info = [ln for ln in done.stderr.splitlines() if ln.startswith("INFO ")]
    assert info and all(ln == ln.rstrip() for ln in done.stderr.splitlines()), done.stderr
    assert any("tokens" in ln and str(tmp_path / "s") in ln for ln in info), done.stderr


def test_a_yes_no_option_is_written_alone_or_with_its_word():
    """``--overwrite`` alone worked but ``--overwrite true`` was refused as an unexpected argument, while
    ``--run.tensorboard true`` worked and ``--run.tensorboard`` alone needed a value: every yes/no option now takes
    both spellings, and a flag that says no (``--no_progress``) stays a flag."""
    from gptoughts.cli.options import parse_overrides
    from gptoughts.config import load_config
    from gptoughts.errors import ConfigError

    argv = ["--overwrite", "false", "--run.tensorboard", "--wandb", "no", "--perf.ignore_memory_estimate",
            "--no_progress", "--max_steps", "3"]  # fmt: skip
    _, overrides, _ = parse_overrides(argv)
    cfg = load_config(overrides={**overrides, "data.sources": ["x.txt"]})
    assert (cfg.run.overwrite, cfg.run.tensorboard, cfg.run.wandb) == (False, True, False)
    assert cfg.perf.ignore_memory_estimate is True and cfg.run.progress is False and cfg.train.max_steps == 3
    assert parse_overrides(["--overwrite"])[1] == {"run.overwrite": True}
    with pytest.raises(ConfigError, match="run.overwrite must be true or false, got 'maybe'"):
        load_config(overrides=parse_overrides(["--overwrite", "maybe"])[1])


def test_config_flag_names_the_toml_file_as_the_positional_preset_does(tmp_path):
    """``--config FILE.toml`` (other tools' spelling) was refused with a hint to --print_config; it names the preset
    or TOML file, whose values the flags beside it replace (README "Where a run starts")."""
    from gptoughts.cli.options import parse_overrides
    from gptoughts.config import load_config
    from gptoughts.errors import ConfigError

    toml = tmp_path / "mine.toml"
    toml.write_text("[train]\nmax_steps = 5\nbatch_size = 3\n")
    preset, overrides, _ = parse_overrides(["--batch_size", "4", f"--config={toml}"])
    assert preset == str(toml)
    cfg = load_config(preset, overrides)
    assert (cfg.train.max_steps, cfg.train.batch_size) == (5, 4)
    with pytest.raises(ConfigError, match="two configs given"):
        parse_overrides(["quickstart", "--config", str(toml)])


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--parallel", "2"], "--parallel is a section; its options are written --parallel.KEY VALUE"),
        (["--train.lr", "1e-3"], "did you mean --train.learning_rate?"),
    ],
)
def test_a_section_or_an_alias_misplaced_is_named_with_the_option_meant(argv, needle):
    """``--parallel 2`` was answered "did you mean --profile?" and ``--train.lr`` named no option at all."""
    from gptoughts.cli.options import parse_overrides
    from gptoughts.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        parse_overrides(argv)
    assert needle in str(e.value)


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["--lora", "3"], "lora.enabled"),
        (["--lora"], "lora.enabled"),
        (["--lora_r", "8"], "lora.r"),
        (["--qlora"], "lora.quantize"),
        (["--target_modules", "q_proj"], "lora.target_modules"),
        (["--beta", "0.1"], "dpo.beta"),  # a bare field of [dpo], not a misspelt --beta2
        (["--lora.r", "8"], None),
        (["--dpo.beta", "0.1"], None),
    ],
)
def test_a_finetune_option_given_to_train_names_the_finetune_command(
    argv, key, tmp_path, monkeypatch, capsys
):
    """``gptoughts train --lora 3`` answered "did you mean --lr?" and ``--lora.r 8`` listed train's sections: the
    options only ``gptoughts finetune`` takes are named as its, in one line, and finetune still reads them."""
    from gptoughts.cli.options import TRAIN_SECTIONS, parse_overrides
    from gptoughts.cli.train import FINETUNE_ALIASES, FINETUNE_FLAGS

    monkeypatch.chdir(tmp_path)
    code, text = cli.main(["train", *argv, "--dry_run"]), capsys.readouterr().err
    option = argv[0] + (f" ({key})" if key else "")
    assert code != 0 and text.strip().count("\n") == 0 and "Traceback" not in text, text
    assert f"{option} is an option of `gptoughts finetune`" in text and "did you mean" not in text, text
    assert list(tmp_path.iterdir()) == []
    finetune = (FINETUNE_ALIASES, FINETUNE_FLAGS, (*TRAIN_SECTIONS, "lora", "dpo"))
    _, overrides, _ = parse_overrides(argv, *finetune)
    assert list(overrides) == [key or argv[0][2:]]
