"""The plan warns about the user's choices, not a shipped preset's: the quickstart's 6 MB cap on its demo corpus and
its 10M model on that corpus are ours, stated in the plan's corpus line without a warning; the same cap given as a
flag, or in the user's own TOML file, is warned about."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from gptoughts.config import load_config
from gptoughts.models import get_family
from gptoughts.training import plan


def _warnings(cfg) -> list[str]:
    data = SimpleNamespace(
        init_from=None,
        manifest=None,
        corpus={"cut": True, "bytes_read": 6_000_000, "bytes": 32_000_000, "val_tokens": 5_000},
    )
    batch = SimpleNamespace(
        train_tokens=1_500_000,
        epochs=0.2,
        block_size=128,
        eval_block=None,
        total_steps=250,
        tokens_per_step=1024,
    )
    model = SimpleNamespace(family=get_family("llama"))
    return plan._warnings(cfg, data, model, batch, 10_000_000, None, None, on_cpu=True)


def test_a_shipped_presets_own_choices_are_not_warned_about():
    cfg = load_config(None, {})
    assert {"data.max_bytes", "data.sources", "model.size"} <= cfg.shipped <= cfg.given
    assert not [w for w in _warnings(cfg) if "max_bytes" in w or "smaller than the model" in w]


def test_the_same_cap_as_a_flag_or_in_the_users_file_is_warned_about(tmp_path: Path):
    flagged = load_config(None, {"data.max_bytes": 6_000_000})
    assert "data.max_bytes" not in flagged.shipped
    assert any("data.max_bytes = 6,000,000 cuts the corpus" in w for w in _warnings(flagged))
    mine = tmp_path / "mine.toml"
    mine.write_text((Path(plan.__file__).parents[1] / "presets" / "quickstart.toml").read_text())
    own = load_config(str(mine), {})
    assert own.shipped == frozenset()
    found = _warnings(own)
    assert any("cuts the corpus" in w for w in found) and any("smaller than the model" in w for w in found)


def test_a_resumed_run_keeps_which_values_its_shipped_preset_set(tmp_path: Path):
    """run.json records the shipped keys beside the given ones: a resume warns no more than the first start did
    (a newcomer's resumed quickstart printed the two warnings its first start had not)."""
    import json

    from gptoughts.config import to_toml

    out = tmp_path / "run"
    out.mkdir()
    first = load_config(None, {"run.out": str(out)})
    (out / "config.toml").write_text(to_toml(first))
    (out / "run.json").write_text(
        json.dumps({"given": sorted(first.given), "shipped": sorted(first.shipped)})
    )
    resumed = load_config(None, {"run.out": str(out), "run.resume": "auto", "train.max_steps": 300})
    assert resumed.shipped == first.shipped - {"train.max_steps"}
    assert "data.max_bytes" in resumed.shipped
    assert not [w for w in _warnings(resumed) if "max_bytes" in w or "smaller than the model" in w]
