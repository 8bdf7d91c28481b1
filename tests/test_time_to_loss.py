"""bench/time_to_loss.py at debug size on a CPU: every variant on the same shards and budget, the target rule
(adamw reaches its own final loss at its last evaluation; a variant that never reaches a target reports null),
reuse of recorded variants, and a missing preset skipped with one line."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("time_to_loss", ROOT / "bench" / "time_to_loss.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("time_to_loss", mod)
    spec.loader.exec_module(mod)
    return mod


def _has_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


def test_target_rule():
    ttl = _script()
    curve = [
        {"step": 4, "tokens": 512, "seconds": 1.0, "val_loss": 3.0},
        {"step": 8, "tokens": 1024, "seconds": 2.0, "val_loss": 2.5},
        {"step": 12, "tokens": 1536, "seconds": 3.0, "val_loss": 2.7},
    ]
    assert ttl.time_to_target(curve, 2.7)["step"] == 8  # the first evaluation at or under it
    assert ttl.time_to_target(curve, 2.5)["tokens"] == 1024
    assert ttl.time_to_target(curve, 2.0) is None
    assert ttl.time_to_target(curve, None) is None
    rows = [
        {"name": "adamw", "curve": curve, "tokens_per_s": 100.0},
        {
            "name": "muon",
            "curve": [{**p, "val_loss": p["val_loss"] - 0.6} for p in curve],
            "tokens_per_s": 50.0,
        },
    ]
    ttl.finish(rows, 2.5)
    adamw, muon = rows
    assert (adamw["tokens_to_target"], muon["tokens_to_target"]) == (1024, 512)
    assert muon["vs_adamw"] == {"speedup": 2.0, "token_efficiency": 2.0, "throughput": 0.5}
    assert muon["vs_hf"] is None and muon["to_hf_final"] is None  # no hf row

    # With a Trainer row: each variant's time to the Trainer's final val loss over the Trainer's whole run.
    hf_curve = [{**p, "seconds": p["seconds"] * 4, "val_loss": v} for p, v in zip(curve, (3.2, 2.9, 2.6))]
    rows.append(
        {"name": "hf", "status": "ok", "curve": hf_curve, "final_val_loss": 2.6, "total_seconds": 16.0}
    )
    ttl.finish(rows, 2.5)
    adamw, muon, hf = rows
    assert adamw["to_hf_final"] == {"val_loss": 2.6, "tokens": 1024, "seconds": 2.0, "vs_hf_total": 0.125}
    assert muon["to_hf_final"]["seconds"] == 1.0 and muon["to_hf_final"]["vs_hf_total"] == 1.0 / 16
    assert hf["to_hf_final"]["seconds"] == 12.0  # its own final, at its last evaluation
    rows[0]["curve"] = [{**p, "val_loss": 3.0} for p in curve]  # a variant that never gets there
    ttl.finish(rows, 2.5)
    assert rows[0]["to_hf_final"]["seconds"] is None and rows[0]["to_hf_final"]["vs_hf_total"] is None
    for r in rows:
        r.update(
            status=r.get("status", "ok"), final_val_loss=r.get("final_val_loss", 2.0), total_seconds=20.0
        )
    assert "reached by: adamw never, muon at 1.0 s (0.06x the Trainer's whole run)" in ttl.table(rows, 2.5)


@pytest.mark.slow
def test_time_to_loss_on_cpu(text_corpus, cache_dir, tmp_path, capsys):
    ttl = _script()
    variants = ["adamw", "muon"] + (["hf"] if _has_transformers() else [])
    out = tmp_path / "ttl"
    argv = ["--data", str(text_corpus), "--size", "debug", "--tokenizer", "bytes", "--block_size", "32",
            "--batch_size", "4", "--grad_accum", "1", "--max_tokens", "2048", "--eval_every", "4",
            "--eval_batches", "2", "--device", "cpu", "--threads", "1", "--out", str(out)]  # fmt: skip
    res = ttl.main([*argv, "--variants", ",".join(variants)])
    assert json.loads((out / "results.json").read_text()) == json.loads(json.dumps(res))
    rows = {r["name"]: r for r in res["variants"]}
    assert list(rows) == variants
    assert res["tokens"] == 2048 and res["steps"] == 16
    for name, r in rows.items():
        assert r["status"] == "ok", (name, (out / f"{name}.log").read_text()[-2000:])
        # the same budget and the same shards for every variant
        assert (r["steps"], r["tokens_per_step"], r["tokens"]) == (16, 128, 2048), name
        assert r["same_shards"] and r["data"] == res["shards"], name
        assert [p["step"] for p in r["curve"]] == [4, 8, 12, 16], name
        assert r["final_val_loss"] == r["curve"][-1]["val_loss"]
        secs = [p["seconds"] for p in r["curve"]]
        assert 0 < secs[0] and secs == sorted(secs) and secs[-1] <= r["total_seconds"], name
        assert r["startup_seconds"] is not None and r["train_tokens_per_s"] > 0, name
        assert r["tokens_per_s"] == pytest.approx(2048 / r["total_seconds"], rel=1e-3)
    adamw = rows["adamw"]
    assert res["target"] == adamw["final_val_loss"] and res["target_source"].startswith("adamw")
    assert (
        adamw["tokens_to_target"] == 2048 and adamw["step_to_target"] == 16
    )  # its own final, at its last eval
    assert adamw["seconds_to_target"] == adamw["curve"][-1]["seconds"]
    assert adamw["vs_adamw"]["speedup"] == 1.0 and adamw["vs_adamw"]["token_efficiency"] == 1.0
    if "hf" in rows:
        assert rows["hf"]["vs_hf"]["throughput"] == 1.0
        assert abs(rows["hf"]["curve"][0]["val_loss"] - adamw["curve"][0]["val_loss"]) < 0.5  # same scale
    text = capsys.readouterr().out
    assert "target val loss" in text and "adamw" in text

    # Again with --reuse: nothing re-runs; an unreachable target gives nulls; a missing preset is one skip line.
    res2 = ttl.main([*argv, "--variants", ",".join([*variants, "ghost"]), "--reuse", "--target", "0.5",
                     "--define", "ghost=no-such-preset-xyz --lr 1e-3"])  # fmt: skip
    rows2 = {r["name"]: r for r in res2["variants"]}
    assert rows2["ghost"]["status"] == "skipped" and "no-such-preset-xyz" in rows2["ghost"]["reason"]
    assert "skip ghost: unknown preset" in capsys.readouterr().out
    for name in variants:
        r = rows2[name]
        assert r["status"] == "reused" and r["total_seconds"] == rows[name]["total_seconds"], name
        assert r["tokens_to_target"] is None and r["seconds_to_target"] is None, name
        assert r["vs_adamw"]["speedup"] is None and r["vs_adamw"]["token_efficiency"] is None, name
