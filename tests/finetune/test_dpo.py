"""Preference tuning (DPO) on the one trainer: the loss against its formula, the pairs' rendering and checks, full and
LoRA runs that learn a held-out preference, exact LoRA resume, the export, and ``gptoughts eval --prefs``."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_helpers import losses as run_losses
from hf_helpers import make_tokenizer, transformers

from gptoughts import api, cli
from gptoughts.data.prefs import PrefData
from gptoughts.training.dpo import DPO, completion_logps, dpo_loss
from gptoughts.training.trainer import Trainer

ALPHABET = "abcdefghijklmnopqrstuvwxyz"


def prefs_file(path: Path, n: int = 160, seed: int = 0) -> Path:
    """Chosen: the alphabet's real continuation of the prompt; rejected: the same letters shuffled."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        s = rng.randrange(26)
        chosen = "".join(ALPHABET[(s + 3 + k) % 26] for k in range(6))
        rejected = list(chosen)
        while "".join(rejected) == chosen:
            rng.shuffle(rejected)
        prompt = "".join(ALPHABET[(s + k) % 26] for k in range(3))
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": "".join(rejected)})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _opts(ft_fast: dict, **kw) -> dict:
    o = dict(ft_fast)
    o.update(
        {
            "train.objective": "dpo",
            "train.block_size": 48,
            "train.batch_size": 8,
            "train.sample_prompts": [],
            "train.eval_interval": 10,
            "train.log_interval": 5,
            "data.val_fraction": 0.2,
        }
    )
    o.update(kw)
    return o


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------------------ the loss


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_dpo_loss_matches_the_formula(smoothing):
    pc, pr = torch.tensor([-3.0, -5.0, -2.0]), torch.tensor([-4.0, -4.5, -2.0])
    rc, rr = torch.tensor([-3.5, -5.0, -1.0]), torch.tensor([-4.0, -4.0, -3.0])
    beta = 0.3
    losses, margin = dpo_loss(pc - pr, rc - rr, beta, smoothing)
    for i in range(3):
        m = beta * ((pc[i] - pr[i]) - (rc[i] - rr[i])).item()
        sig = 1 / (1 + math.exp(-m))
        want = -(1 - smoothing) * math.log(sig) - smoothing * math.log(1 - sig)
        assert losses[i].item() == pytest.approx(want, rel=1e-6)
        assert margin[i].item() == pytest.approx(m, rel=1e-6)


def test_completion_logps_sum_the_targets_and_chunks_give_the_same_gradients():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 5, 8, generator=g, requires_grad=True)
    w = torch.randn(11, 8, generator=g, requires_grad=True)
    y = torch.randint(0, 11, (6, 5), generator=g)
    y[:, :2] = -100
    logp = torch.log_softmax(h @ w.T, -1).gather(-1, y.clamp_min(0)[..., None])[..., 0]
    want = torch.where(y != -100, logp, 0.0).sum(-1)
    plain = completion_logps(h, w, y)
    torch.testing.assert_close(plain, want)
    gh, gw = torch.autograd.grad((plain * torch.arange(6.0)).sum(), (h, w))
    chunked = completion_logps(h, w, y, chunk_rows=4)
    torch.testing.assert_close(chunked, plain)
    ch, cw = torch.autograd.grad((chunked * torch.arange(6.0)).sum(), (h, w))
    torch.testing.assert_close(ch, gh)
    torch.testing.assert_close(cw, gw)


# ------------------------------------------------------------------------------------------------ the data


def test_pairs_render_with_the_chat_template_and_only_the_completion_is_a_target(tmp_path):
    tok = make_tokenizer()
    f = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "hi", "chosen": "yes", "rejected": "no"},
        {
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"},
            ],
            "chosen": {"role": "assistant", "content": "good"},
            "rejected": {"content": "bad"},
        },
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    data = PrefData([str(f)], tok, block_size=64)
    x, ref, y = data.batch(np.arange(2), torch.device("cpu"))
    assert x.shape == (2, 2, 64) and y.shape == (2, 2, 64) and torch.isnan(ref).all()
    decoded = [tok.decode([t for t in y[i, k].tolist() if t != -100]) for i in range(2) for k in (0, 1)]
    # the completion and the template's end-of-turn marker; nothing of the prompt (nor the earlier answer "b")
    assert decoded == ["yes<|im_end|>\n", "no<|im_end|>\n", "good<|im_end|>\n", "bad<|im_end|>\n"]
    full = tok.decode([t for t in x[1, 0].tolist() if t != data.pad_id])
    assert full.startswith("<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>")


BAD_LINES = {
    "missing": ({"prompt": "p", "chosen": "c"}, 'missing "rejected"'),
    "type": ({"prompt": "p", "chosen": 3, "rejected": "r"}, '"chosen" must be a string, not int'),
    "empty": ({"prompt": "p", "chosen": "c", "rejected": "  "}, '"rejected" is empty'),
    "json": ('{"prompt": "p", "chosen": ', "invalid JSON"),
}


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_malformed_pairs_are_one_line_and_nothing_is_written(kind, hf_model, tmp_path, capsys, ft_cache):
    line, expected = BAD_LINES[kind]
    f = tmp_path / "p.jsonl"
    good = json.dumps({"prompt": "p", "chosen": "c", "rejected": "r"})
    f.write_text(good + "\n" + (line if isinstance(line, str) else json.dumps(line)) + "\n")
    run = tmp_path / "run"
    args = ["finetune", "--model", str(hf_model("llama")), "--objective", "dpo", "--data", str(f)]
    capsys.readouterr()  # (saving the model folder prints progress)
    rc = cli.main([*args, "--out", str(run), "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert f"{f}:2:" in err and expected in err
    assert not run.exists()


def test_pairs_without_objective_dpo_are_refused(hf_model, tmp_path, capsys, ft_cache):
    f, model = prefs_file(tmp_path / "p.jsonl", n=4), hf_model("llama")
    rc = cli.main(["finetune", "--model", str(model), "--data", str(f), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc != 0 and "--objective dpo" in err and not (tmp_path / "r").exists()


# ------------------------------------------------------------------------------------------------ training


@pytest.mark.plots
def test_full_dpo_learns_the_held_out_preference_and_exports(hf_model, tmp_path, ft_fast, ft_cache, capsys):
    base, data = hf_model("llama"), prefs_file(tmp_path / "p.jsonl")
    run = tmp_path / "run"
    api.finetune(
        model_path=str(base),
        data_path=str(data),
        save_dir=str(run),
        **_opts(ft_fast, **{"train.max_steps": 30, "train.learning_rate": 1e-3, "train.log_interval": 1}),
    )
    rows = _rows(run)
    val = [r for r in rows if "val_dpo/accuracy" in r]
    assert val and val[-1]["val_dpo/accuracy"] >= 0.9, val
    assert val[-1]["val_dpo/reward_margin"] > val[0]["val_dpo/reward_margin"] > 0
    train = [r for r in rows if "dpo/accuracy" in r]
    assert train and all(0 <= r["dpo/accuracy"] <= 1 for r in train)
    losses = run_losses(run)
    assert losses[1] == pytest.approx(math.log(2), abs=1e-5)  # the first step's policy is its reference
    assert losses[max(losses)] < 0.5
    assert (run / "plots" / "preference.png").exists()

    held = prefs_file(tmp_path / "held.jsonl", n=40, seed=1)
    capsys.readouterr()
    assert cli.main(["eval", str(run), "--prefs", str(held), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)["prefs"]
    assert res["preference_accuracy"] >= 0.9 and res["reference"] == str(base)

    out = tmp_path / "hf"
    api.export(run, out)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = model(input_ids=ids).logits
        ours = api.load(run).model(ids)
    assert (theirs - ours).abs().max().item() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize(
    "head", [{}, {"dpo.head": "fused", "dpo.logp_chunk_tokens": 40}], ids=["plain", "fused"]
)
def test_lora_dpo_resumes_exactly(head, hf_model, tmp_path, ft_fast, ft_cache, monkeypatch):
    """Stopped at step 5 and resumed, a LoRA-DPO run's losses equal an uninterrupted run's; also with the fused head
    walking the frozen head in token chunks."""
    base, data = hf_model("llama"), prefs_file(tmp_path / "p.jsonl", n=64)
    o = _opts(ft_fast, **{"train.max_steps": 10, "train.learning_rate": 1e-2, "lora.dropout": 0.1,
                          "train.log_interval": 1, **head})  # fmt: skip

    def go(out: Path, **kw) -> None:
        api.finetune(model_path=str(base), data_path=str(data), lora=True, save_dir=str(out), **o, **kw)

    go(tmp_path / "a")
    original = Trainer.train_step

    def stop_at_5(self):
        out = original(self)
        if self.state.step + 1 == 5:
            self.stop_requested = True
        return out

    monkeypatch.setattr(Trainer, "train_step", stop_at_5)
    go(tmp_path / "b")
    monkeypatch.setattr(Trainer, "train_step", original)
    assert max(run_losses(tmp_path / "b")) == 5
    go(tmp_path / "b", **{"run.resume": "auto"})
    a, b = run_losses(tmp_path / "a"), run_losses(tmp_path / "b")
    assert sorted(a) == sorted(b) == list(range(1, 11))
    assert all(a[s] == b[s] for s in a), (a, b)
    margins = {r["step"]: r["dpo/reward_margin"] for r in _rows(tmp_path / "a") if "dpo/reward_margin" in r}
    assert margins[10] > margins[1]


def test_lora_reference_is_the_base_with_adapters_disabled(hf_model, tmp_path, ft_fast, ft_cache):
    """The adapters-off reference of a trained LoRA model equals the base model's log-ratios."""
    from gptoughts.training.dpo import _tuner_layers, adapters_disabled

    base, data = hf_model("llama"), prefs_file(tmp_path / "p.jsonl", n=16)
    run = tmp_path / "run"
    api.finetune(
        model_path=str(base),
        data_path=str(data),
        lora=True,
        save_dir=str(run),
        **_opts(ft_fast, **{"train.max_steps": 4, "train.learning_rate": 5e-2, "train.eval_interval": 0}),
    )
    loaded, plain = api.load(run), api.load(base)
    pairs = PrefData([str(data)], loaded.tokenizer, block_size=48)
    x, _, y = pairs.batch(np.arange(16), torch.device("cpu"))
    dpo = DPO()
    with torch.no_grad():
        tuned = dpo.logratio(loaded.model, x, y)
        with adapters_disabled(_tuner_layers(loaded.model)):
            off = dpo.logratio(loaded.model, x, y)
        ref = dpo.logratio(plain.model, x, y)
    torch.testing.assert_close(off, ref, atol=1e-5, rtol=1e-5)
    assert (tuned - ref).abs().max() > 1e-3


@pytest.mark.slow
def test_lora_precomputed_reference_gives_the_adapters_off_losses(hf_model, tmp_path, ft_fast, ft_cache):
    """dpo.reference = precomputed (a switch for LoRA) computes what adapters_off computes: the adapters start at
    zero, so the starting model is the base."""
    base, data = hf_model("llama"), prefs_file(tmp_path / "p.jsonl", n=24)
    o = _opts(ft_fast, **{"train.max_steps": 4, "train.learning_rate": 5e-2, "train.log_interval": 1})
    for ref in ("adapters_off", "precomputed"):
        api.finetune(
            model_path=str(base), data_path=str(data), lora=True, save_dir=str(tmp_path / ref),
            **o, **{"dpo.reference": ref},
        )  # fmt: skip
    off, pre = run_losses(tmp_path / "adapters_off"), run_losses(tmp_path / "precomputed")
    assert sorted(off) == [1, 2, 3, 4] and off[4] < off[1]
    for s in off:
        assert pre[s] == pytest.approx(off[s], abs=1e-5)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"dpo.beta": 0.0}, "dpo.beta must be > 0"),
        ({"dpo.label_smoothing": 0.5}, "dpo.label_smoothing must be in [0, 0.5)"),
        ({"dpo.reference": "adapters_off"}, "needs --lora"),
        ({"train.batch_size": "auto"}, "--batch_size N"),
    ],
)
def test_dpo_settings_are_checked(overrides, message, hf_model):
    from gptoughts.config import load_config
    from gptoughts.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(")", r"\)")):
        load_config(
            "finetune", {"model.init_from": str(hf_model("llama")), "train.objective": "dpo", **overrides}
        )
