"""Preference tuning (DPO) where it meets the features around it: a DPO run's chat template (sampling, export),
``[dpo]`` settings on a run that is not DPO, the spike check against a per-pair loss, what the plan and the end of
the log say, a tiny pair file's held-out split, and the exact resume of a full fine-tuning DPO run."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from cli_helpers import QUIET_CPU, refused, refused_leaving, run_cli
from hf_helpers import losses as run_losses
from test_dpo import _opts, _rows, prefs_file

from gptoughts import api, cli
from gptoughts.config import load_config
from gptoughts.data.sft import DEFAULT_CHAT_TEMPLATE
from gptoughts.errors import ConfigError
from gptoughts.training.trainer import Trainer

DPO_CLI = [*QUIET_CPU, "--block_size", "48", "--batch_size", "4", "--sample_prompts", "hi"]


# ------------------------------------------------------------------------------------- the chat template


def test_a_dpo_run_samples_and_exports_with_the_template_it_trained_on(hf_model, tmp_path, ft_fast, ft_cache):
    """Pairs are rendered like SFT turns (the default template when the tokenizer has none): the run loads as a
    chat model and its export carries that template, as an SFT run's does."""
    base = hf_model("llama", name="no-template", chat_template=None)
    run = tmp_path / "run"
    api.finetune(
        model_path=str(base),
        data_path=str(prefs_file(tmp_path / "p.jsonl", n=8)),
        save_dir=str(run),
        **_opts(ft_fast, **{"train.max_steps": 1, "data.val_fraction": 0.0}),
    )
    assert api.load(run).chat
    out = api.export(run, tmp_path / "hf")
    assert (out / "chat_template.jinja").read_text(encoding="utf-8") == DEFAULT_CHAT_TEMPLATE


# ------------------------------------------------------------------------------ [dpo] without --objective dpo


def test_dpo_settings_without_objective_dpo_are_refused(hf_model, tmp_path, capsys, ft_cache):
    """An SFT fine-tuning run given --dpo.beta would silently ignore it: refused in one line, nothing written."""
    base, sft = hf_model("llama"), tmp_path / "sft.jsonl"
    sft.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    with pytest.raises(ConfigError, match=r"dpo\.beta .*--objective dpo"):
        load_config("finetune", {"model.init_from": str(base), "dpo.beta": 0.3})
    run = tmp_path / "run"
    argv = [
        "finetune",
        "--model",
        str(base),
        "--data",
        str(sft),
        "--out",
        str(run),
        "--label_smoothing",
        "0.1",
    ]
    refused([*argv, *DPO_CLI], capsys, "dpo.label_smoothing", "--objective dpo")
    assert not run.exists()
    # the defaults written to every run's config.toml are not the user's: an SFT run still resumes
    cfg = load_config("finetune", {"model.init_from": str(base), "dpo.beta": 0.1})
    assert cfg.train.objective == "auto"


def test_dpo_options_on_pretraining_are_one_line(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n" * 50)
    argv = ["train", "--data", str(corpus), "--out", str(tmp_path / "run"), "--dpo.beta", "0.3", *DPO_CLI]
    refused_leaving(tmp_path, argv, capsys, "--dpo.beta")


# ------------------------------------------------------------------------------------------- loss spikes


def test_dpo_turns_the_token_mean_spike_check_off_unless_asked(hf_model):
    base = hf_model("llama")
    cfg = load_config("finetune", {"model.init_from": str(base), "train.objective": "dpo"})
    assert cfg.recovery.spike_detection is False
    assert "a few pairs" in cfg.resolved["spike_detection"]
    asked = {"model.init_from": str(base), "train.objective": "dpo", "recovery.spike_detection": True}
    assert load_config("finetune", asked).recovery.spike_detection is True
    assert load_config("finetune", {"model.init_from": str(base)}).recovery.spike_detection is True


def _noisy_prefs(path: Path) -> Path:
    """The alphabet pairs with one in ten flipped: real preference sets hold mislabeled pairs."""
    prefs_file(path, n=128, seed=3)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rng = random.Random(0)
    for r in rows:
        if rng.random() < 0.1:
            r["chosen"], r["rejected"] = r["rejected"], r["chosen"]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_a_dpo_run_keeps_its_hard_batches(hf_model, tmp_path, ft_fast, ft_cache, monkeypatch):
    """A batch of two pairs holding a flipped one has a loss several times the running mean once the model has
    learned the majority: the token-mean spike rule held it, re-ran it (the same loss, step 23 here) and dropped
    the step."""
    o = {**ft_fast, "train.objective": "dpo", "train.block_size": 48, "train.batch_size": 2, "train.max_steps": 150,
         "train.learning_rate": 2e-3, "train.sample_prompts": [], "train.log_interval": 10,
         "recovery.spike_warmup_steps": 10}  # fmt: skip
    original = Trainer.train_step

    def stop_at_30(self):
        out = original(self)
        self.stop_requested = self.state.step + 1 >= 30  # (the step is counted after train_step)
        return out

    monkeypatch.setattr(Trainer, "train_step", stop_at_30)
    run = tmp_path / "run"
    data = _noisy_prefs(tmp_path / "p.jsonl")
    api.finetune(model_path=str(hf_model("llama")), data_path=str(data), save_dir=str(run), **o)
    rows = _rows(run)
    assert not [r for r in rows if r.get("event") == "spike"]
    assert max(run_losses(run)) == 30 and all(r.get("skipped_steps", 0) == 0 for r in rows)


# ----------------------------------------------------------------------------------- the plan and the end


def test_the_plan_says_what_a_dpo_run_does(hf_model, tmp_path, capsys, ft_cache):
    base = hf_model("llama")
    one = tmp_path / "one.jsonl"
    one.write_text(prefs_file(tmp_path / "p.jsonl", n=1).read_text())
    argv = ["finetune", "--model", str(base), "--objective", "dpo", "--data", str(one), "--max_steps", "1"]
    code, text = run_cli([*argv, "--out", str(tmp_path / "run"), "--beta", "0.25", *DPO_CLI], capsys)
    assert code == 0, text[-2000:]
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("objective:"))
    assert "dpo" in line and "beta 0.25" in line and "reference: precomputed" in line, line
    assert "head: fused (a chunk of pairs at a time" in line, line  # the default
    steps = next(ln for ln in text.splitlines() if ln.strip().startswith("steps:"))
    assert "no evaluation (no held-out pairs)" in steps, steps
    assert "1 pairs (1 train, 0 val)" in text

    code, text = run_cli(
        [*argv, "--out", str(tmp_path / "lora"), "--lora", *DPO_CLI, "--dpo.head", "plain"], capsys
    )
    assert code == 0, text[-2000:]
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("objective:"))
    assert "beta 0.1" in line and "reference: adapters_off" in line, line
    assert "head: plain (every row's logits at once)" in line, line


def test_the_end_of_a_dpo_run_reports_preferences_not_perplexity(hf_model, tmp_path, capsys, ft_cache):
    base, data = hf_model("llama"), prefs_file(tmp_path / "p.jsonl", n=20)
    run = tmp_path / "run"
    argv = ["finetune", "--model", str(base), "--objective", "dpo", "--data", str(data), "--max_steps", "2"]
    code, text = run_cli([*argv, "--out", str(run), "--val_fraction", "0.2", *DPO_CLI], capsys)
    assert code == 0, text[-2000:]
    done = next(ln for ln in text.splitlines() if ln.startswith("done"))
    assert "perplexity" not in done and "preference accuracy" in done, done
    assert f"gptoughts eval {run} --prefs PAIRS.jsonl" in text
    summary = json.loads((run / "summary.json").read_text())
    assert 0.0 <= summary["preference"]["val_dpo/accuracy"] <= 1.0


# ----------------------------------------------------------------------------------------------- resume


@pytest.mark.slow
def test_full_dpo_resumes_exactly(hf_model, tmp_path, ft_fast, ft_cache, monkeypatch):
    """The precomputed reference is the starting model's, computed again on resume (before the checkpoint's
    weights load): the resumed losses equal an uninterrupted run's."""
    base, data = hf_model("llama"), prefs_file(tmp_path / "p.jsonl", n=48)
    o = _opts(ft_fast, **{"train.max_steps": 8, "train.learning_rate": 1e-3, "train.log_interval": 1})

    def go(out: Path, **kw) -> None:
        api.finetune(model_path=str(base), data_path=str(data), save_dir=str(out), **o, **kw)

    go(tmp_path / "a")
    original = Trainer.train_step

    def stop_at_4(self):
        out = original(self)
        if self.state.step + 1 == 4:
            self.stop_requested = True
        return out

    monkeypatch.setattr(Trainer, "train_step", stop_at_4)
    go(tmp_path / "b")
    monkeypatch.setattr(Trainer, "train_step", original)
    go(tmp_path / "b", **{"run.resume": "auto"})
    a, b = run_losses(tmp_path / "a"), run_losses(tmp_path / "b")
    assert sorted(a) == sorted(b) == list(range(1, 9))
    assert all(a[s] == b[s] for s in a), (a, b)


def test_the_plan_of_an_sft_run_with_nothing_held_out_says_no_evaluation(
    hf_model, tmp_path, capsys, ft_cache
):
    # One example: the split holds none out, so no evaluation runs, and the plan must not promise one.
    base, data = hf_model("llama"), tmp_path / "one.jsonl"
    data.write_text(json.dumps({"prompt": "2+2?", "response": "4"}) + "\n")
    argv = [
        "finetune",
        "--model",
        str(base),
        "--data",
        str(data),
        "--max_steps",
        "1",
        "--out",
        str(tmp_path / "r"),
    ]
    code, text = run_cli([*argv, *DPO_CLI], capsys)
    assert code == 0, text[-2000:]
    steps = next(ln for ln in text.splitlines() if ln.strip().startswith("steps:"))
    assert "no evaluation (no held-out examples)" in steps, steps
    assert "val loss" not in text  # and the run does as its plan says


def test_eval_of_several_models_shows_their_preferences_in_the_table(hf_model, tmp_path, capsys, ft_cache):
    """``gptoughts eval A B --prefs held.jsonl``: the comparison table has the preference accuracy and reward
    margin of each model (it had only the loss and the tasks' rows), the same numbers as ``--json``."""
    a, b = hf_model("llama", name="a"), hf_model("qwen2", name="b")
    held = prefs_file(tmp_path / "held.jsonl", n=12, seed=1)
    capsys.readouterr()
    assert cli.main(["eval", str(a), str(b), "--prefs", str(held), "--device", "cpu", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res[str(a)]["prefs"] != res[str(b)]["prefs"]  # two different models
    code, out = run_cli(["eval", str(a), str(b), "--prefs", str(held), "--device", "cpu"], capsys)
    assert code == 0, out
    for metric in ("preference_accuracy", "reward_margin"):
        line = next(x for x in out.splitlines() if x.startswith("prefs") and metric in x)
        cells = line.split()[-2:]
        assert cells == [format(res[str(m)]["prefs"][metric], ".4f") for m in (a, b)], (line, res)
        assert line.split()[2] == "12"  # the pairs scored


def test_no_usable_pair_suggests_only_what_would_help(tmp_path):
    """Pairs whose prompt fills block_size were refused with "...; use data.truncation = right", the setting in use."""
    from hf_helpers import make_tokenizer

    from gptoughts.data.prefs import PrefData
    from gptoughts.errors import DataError

    pairs = tmp_path / "p.jsonl"
    pairs.write_text(json.dumps({"prompt": "p" * 80, "chosen": "yes", "rejected": "no"}) + "\n")
    with pytest.raises(DataError, match=r"raise --block_size$"):
        PrefData([str(pairs)], make_tokenizer(), block_size=32, truncation="right")
    with pytest.raises(DataError, match=r"raise --block_size or set data.truncation = right$"):
        PrefData([str(pairs)], make_tokenizer(), block_size=32, truncation="drop")
