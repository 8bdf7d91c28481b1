"""Every command of the README, run as written, and what it built checked against what it asked for.

The commands are read from README.md itself (fenced bash blocks, the Python snippet, the commands table), so a
README edit is tested by the next run. Only sizes and paths are substituted (a big size is checked through
``--dry_run`` at the size written, then trained at the debug size into the run directory the command would have
written); flags are never removed. A few flags are added to keep CI fast (a step limit, CPU, short blocks),
and none of them changes what the command means.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import QUIET_CPU, ok, plan_of

from gptoughts import models
from gptoughts.cli import options as cli_options

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
sys.path.insert(0, str(ROOT / "tests" / "finetune"))

FAST_TRAIN = QUIET_CPU  # added to each training command run for real
SHRINK = {
    "--block_size": "32",
    "--batch_size": "2",
}  # sizes of a batch: substituted where written (auto stays)


def bash_commands() -> list[str]:
    """The `gptoughts`/`torchrun` commands of the README's bash blocks, comments and `pip install ... &&` cut."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.splitlines():
            tokens = shlex.split(line, comments=True)
            if "&&" in tokens:
                tokens = tokens[tokens.index("&&") + 1 :]
            if tokens and tokens[0] in ("gptoughts", "torchrun"):
                out.append(shlex.join(tokens))
    return out


def table_commands() -> list[str]:
    """The commands of the "Other commands" table, optional parts ([...]) and alternatives ([A|B]) left out."""
    table = README[README.index("### Other commands") : README.index("## Fine-tuning")]
    cmds = re.findall(r"^\| `(gptoughts [^`]+)`", table, re.M)
    return [re.sub(r"\s*\[[^\]]*\]", "", c).strip() for c in cmds]


def size_table() -> dict[tuple[str, str], dict[str, int]]:
    rows = re.findall(
        r"^\| (\w+) \| (\w+) \| ([\d,]+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| ([\d,]+) \| ([\d,]+) \|",
        README,
        re.M,
    )
    return {
        (f, s): {
            "vocab": int(v.replace(",", "")),
            "d_model": int(d),
            "layers": int(n),
            "params": int(p.replace(",", "")),
            "params_non_embedding": int(ne.replace(",", "")),
        }
        for f, s, v, d, n, _h, _kv, p, ne in rows
    }


_plan = plan_of


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder laid out as the README assumes: corpus.txt, data/, notes.txt, chat.jsonl, prefs.jsonl,
    path/to/hf_model."""
    import sysconfig

    from hf_helpers import save_hf_model

    d = tmp_path_factory.mktemp("readme")
    std = Path(sysconfig.get_paths()["stdlib"])
    texts = [
        (std / n).read_text(encoding="utf-8")
        for n in (
            "textwrap.py",
            "string.py",
            "shlex.py",
            "bisect.py",
            "heapq.py",
            "fnmatch.py",
            "glob.py",
            "keyword.py",
        )
    ]
    (d / "corpus.txt").write_text("\n\n".join(texts), encoding="utf-8")
    (d / "notes.txt").write_text("\n\n".join(texts[:3]), encoding="utf-8")
    (d / "data").mkdir()
    for i, t in enumerate(texts):
        (d / "data" / f"part{i}.py").write_text(t, encoding="utf-8")
    with open(d / "chat.jsonl", "w", encoding="utf-8") as f:
        for i in range(40):
            f.write(
                json.dumps({"prompt": f"What is {i} plus {i}?", "response": f"{i} plus {i} is {2 * i}."})
                + "\n"
            )
    with open(d / "prefs.jsonl", "w", encoding="utf-8") as f:
        for i in range(40):
            pair = {"prompt": f"What is {i} plus {i}?", "chosen": f"{2 * i}.", "rejected": f"{2 * i + 1}."}
            f.write(json.dumps(pair) + "\n")
    save_hf_model(d / "path" / "to" / "hf_model", "llama")
    return d


@pytest.fixture
def in_workdir(workdir, monkeypatch, tmp_path):
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("GPTOUGHTS_CACHE", str(workdir / ".cache"))
    return workdir


_run = ok


def _default_out(args: list[str]) -> str:
    """The run directory `gptoughts train ARGS` as written would write (config.default_out)."""
    from gptoughts.config import load_config

    preset, overrides, _ = cli_options.parse_overrides(args)
    return str(load_config(preset, overrides).run.out)


def _substitute(argv: list[str], size: str | None) -> list[str]:
    """``--size`` (or the size a preset names) -> ``size``; batch shapes -> :data:`SHRINK`."""
    out = list(argv)
    for i, tok in enumerate(out[:-1]):
        if tok == "--size" and size is not None:
            out[i + 1] = size
        elif tok in SHRINK and out[i + 1] != "auto":
            out[i + 1] = SHRINK[tok]
    if size is not None and "--size" not in out:
        out += ["--size", size]
    return out


def test_readme_lists_the_commands_this_test_runs():
    cmds = bash_commands()
    assert "gptoughts train" in cmds and any("--resume auto" in c for c in cmds)
    assert sum(c.startswith("torchrun") for c in cmds) == 5 and sum("finetune" in c for c in cmds) == 4
    assert {c.split()[1] for c in table_commands()} >= {
        "prepare",
        "sample",
        "eval",
        "plot",
        "env",
        "bench",
        "estimate",
        "tune",
        "finetune",
        "export",
        "config",
    }


def test_size_table_matches_the_registry():
    """The README's table is the registry's: every family and size, its shape and its parameter count at the
    vocabulary the size trains with (presets/sizes.toml, rounded up to a multiple of 64)."""
    from gptoughts.config import size_defaults

    table = size_table()
    expected = {}
    for fam in models.FAMILIES:
        for size in models.list_sizes(fam):
            tok = size_defaults(fam, size).get("data", {}).get("tokenizer", "bpe:8192")
            vocab = -(-int(tok.split(":")[1]) // 64) * 64
            args = models.model_args(fam, size, {"vocab_size": vocab})
            m = models.build_model(fam, args, device="meta")
            expected[(fam, size)] = {
                "vocab": vocab,
                "d_model": args.d_model,
                "layers": args.n_layers,
                "params": m.num_params(),
                "params_non_embedding": m.num_params(True),
            }
    assert table == expected


@pytest.mark.slow
@pytest.mark.plots  # reads a run's plots, or runs `gptoughts plot`
def test_training_commands_build_what_they_ask(in_workdir, capsys):
    """Each `gptoughts train` line: its plan at the size written (dry run: parameters = the README table, the
    corpus read whole), then a real run at the debug size into the directory the command would write."""
    table = size_table()
    for line in bash_commands():
        argv = shlex.split(line)
        if (
            argv[:2] != ["gptoughts", "train"]
            or "--interactive" in argv
            or "--resume" in argv
            or len(argv) == 2
        ):
            continue
        args = argv[1:]
        text = _run([*args, "--dry_run"] if "--dry_run" not in args else args, capsys)
        family, size, params = _plan(text)
        # The size's shape (a preset's switches may add a little: the speedrun's q/k norms add 1,536 of 135M)
        assert abs(params - table[(family, size)]["params"]) <= 1e-4 * params, line
        assert "read all of it" in text, line
        assert not (in_workdir / _default_out(args[1:])).exists(), f"--dry_run wrote {line}"
        if "--dry_run" in args:
            continue
        out = _default_out(args[1:])
        real = _substitute(args, "debug") + ["--out", out, "--max_steps", "2", *FAST_TRAIN]
        _run(real, capsys)
        run = json.loads((in_workdir / out / "run.json").read_text())
        assert run["family"] == family and run["plan"]["corpus"]["cut"] is False
        assert run["params"] == run["plan"]["params"]
        assert (in_workdir / out / "plots" / "overview.png").is_file()


@pytest.mark.slow
def test_resume_and_interactive_commands(in_workdir, capsys, monkeypatch):
    resume = next(c for c in bash_commands() if "--resume auto" in c)
    argv = shlex.split(resume)
    out = argv[argv.index("--out") + 1]
    if not (in_workdir / out / "run.json").exists():  # the first training command writes it
        _run(
            [
                "train",
                "--data",
                "corpus.txt",
                "--size",
                "debug",
                "--out",
                out,
                "--max_steps",
                "2",
                *FAST_TRAIN,
            ],
            capsys,
        )
    text = _run([*argv[1:], "--max_steps", "4", *FAST_TRAIN], capsys)
    assert "resumed from" in text
    steps = [
        json.loads(x)["step"]
        for x in (in_workdir / out / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in x
    ]
    assert steps == sorted(set(steps)) and steps[-1] == 4
    answers = iter(["debug", "corpus.txt", "0.05", "2"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(answers))
    text = _run(["train", "--interactive", "--out", "runs/interactive", *FAST_TRAIN], capsys)
    family, size, _ = _plan(text)
    assert (family, size) == ("llama", "debug") and "--epochs 0.05" in text


@pytest.mark.slow
def test_torchrun_commands(in_workdir):
    """The torchrun lines on 2 CPU processes (gloo) at the debug size: DDP, FSDP2 (one node or two), a 2-stage
    pipeline (over one FSDP rank here) and tensor parallelism (2 ranks of one tensor-parallel group) train."""
    for line in (c for c in bash_commands() if c.startswith("torchrun")):
        argv = shlex.split(line)
        written = argv[argv.index("train") + 1 :]
        args, out = _substitute(written, "debug"), _default_out(written)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "gptoughts",
            "train",
            *args,
            "--out",
            out,
            "--max_steps",
            "2",
            *FAST_TRAIN,
        ]
        r = subprocess.run(
            cmd,
            cwd=in_workdir,
            capture_output=True,
            text=True,
            timeout=600,
            env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
        )
        assert r.returncode == 0, r.stderr[-3000:]
        run = json.loads((in_workdir / out / "run.json").read_text())
        assert run["world_size"] == 2 and run["family"] == "llama" and run["args"]["d_model"] == 64, line
        assert run["plan"]["batch"]["world_size"] == 2


@pytest.mark.slow
def test_python_snippet(in_workdir, capsys):
    """The README's Python example as written (device auto), with the size and paths substituted."""
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    code = code.replace('size="125m"', 'size="debug"')  # the device as written (auto)
    code = code.replace('"runs/mine"', '"runs/python-api"')
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - our own README, the point of the test
    printed = capsys.readouterr().out
    history = scope["history"]
    assert history.final_val_ppl == history.final_val_ppl and history.final_val_ppl > 1  # finite
    assert history.plan["corpus"]["cut"] is False and history.plan["model"] == "llama/debug"
    assert "def fibonacci(n):" in printed


@pytest.mark.slow
@pytest.mark.plots  # reads a run's plots, or runs `gptoughts plot`
def test_finetune_and_table_commands(in_workdir, capsys):
    """The fine-tuning block, then every command of the "Other commands" table on the runs made above."""
    for line in bash_commands():
        argv = shlex.split(line)
        if argv[1] not in ("finetune", "sample", "export"):
            continue
        extra = (
            ["--max_steps", "2", "--block_size", "64", "--batch_size", "2", *FAST_TRAIN]
            if argv[1] == "finetune"
            else []
        )
        text = _run([*argv[1:], *extra], capsys)
        if argv[1] == "export":
            assert (in_workdir / "exported" / "config.json").is_file()
        if argv[1] == "sample":
            assert text.strip()
    assert json.loads((in_workdir / "runs/ft/run.json").read_text())["lora"] is True
    run = "runs/ft"
    subs = {
        "RUN": run,
        "TEXT": "def",
        "PATH": "corpus.txt",
        "DIR": "shards",
        "HF_DIR": "path/to/hf_model",
        "OUT": "exported2",
        "PRESET": "quickstart",
    }
    for cmd in table_commands():
        argv = shlex.split(cmd)[1:]
        argv = [subs.get(a, a) for a in argv]
        if argv[0] in ("bench", "tune"):
            argv = _substitute(argv, "debug") + ["--device", "cpu"]
        if argv[0] == "bench":
            argv += ["--steps", "2", "--warmup", "1"]
        if argv[0] == "tune":
            argv += ["--steps", "2", "--warmup", "1", "--out", "tuned.toml"]
        if argv[0] == "finetune":
            argv += [
                "--out",
                "runs/ft2",
                "--max_steps",
                "2",
                "--block_size",
                "64",
                "--batch_size",
                "2",
                *FAST_TRAIN,
            ]
        if argv[0] in ("sample", "eval", "export", "plot") and argv[1] == run:
            argv[1] = "runs/llama-125m"  # a run trained from scratch (the first training command wrote it)
        text = _run(argv, capsys)
        if argv[0] == "eval":
            assert "a tail shorter than one is left out" in text and "(--max_batches)" not in text
        if argv[0] == "prepare":
            assert (in_workdir / "shards" / "manifest.json").is_file()
            assert (
                json.loads((in_workdir / "shards" / "manifest.json").read_text())["tokenizer_spec"]
                == "bpe:32768"
            )
        if argv[0] == "estimate":
            assert "GiB" in text and "$" in text
        if argv[0] == "config":
            assert "[model]" in text
