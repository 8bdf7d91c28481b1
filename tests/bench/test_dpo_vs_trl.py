"""bench/dpo_vs_trl.py: the synthetic pairs fill every row exactly (nothing truncated), TRL's examples are our rows'
very tokens with the same completion targets and token count, the reference log-prob comparison's tolerance, and
(where trl is installed) the whole comparison end to end on a tiny CPU model."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from gptoughts.data.tokenizer import bytes_tokenizer
from gptoughts.perf.ce import IGNORE_INDEX

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("dpo_vs_trl", ROOT / "bench" / "dpo_vs_trl.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("dpo_vs_trl", mod)
    spec.loader.exec_module(mod)
    return mod


def test_synthetic_pairs_fill_each_row_and_trl_gets_our_tokens_and_targets(tmp_path):
    bench, tok = _script(), bytes_tokenizer()
    seq, n = 96, 12
    path = bench.write_prefs(tmp_path / "prefs.jsonl", n, seq, bench.template_overhead(tok), seed=3)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == n and all(set(r) == {"prompt", "chosen", "rejected"} for r in lines)
    assert len({len(r["prompt"]) for r in lines}) > 1  # prompts of several lengths, completions fill the rest

    prefs = bench.read_prefs(path, tok, seq)  # raises unless every row is exactly seq tokens, none cut
    assert prefs.stats["truncated"] == 0 and len(prefs) == n
    examples = bench.trl_examples(prefs)
    for i, (ex, line) in enumerate(zip(examples, lines)):
        for k, side in enumerate(("chosen", "rejected")):
            x, y = prefs.rows[2 * i + k]
            full = ex["prompt_ids"] + ex[f"{side}_ids"]
            assert full == [*x.tolist(), int(y[-1])]  # the row TRL's collator builds is our row
            # TRL scores the tokens after the prompt; ours scores the targets: the same tokens, in order
            assert y[y != IGNORE_INDEX].tolist() == ex[f"{side}_ids"]
            assert ex[f"{side}_ids"] == tok.encode(line[side]) + [tok.eos_id]
    ours, theirs = bench.our_pair_tokens(prefs), bench.trl_pair_tokens(examples)
    assert ours == theirs == [2 * seq] * n

    again = bench.write_prefs(tmp_path / "again.jsonl", n, seq, bench.template_overhead(tok), seed=3)
    assert again.read_text() == path.read_text()  # the same pairs from the same seed
    other = bench.write_prefs(tmp_path / "other.jsonl", n, seq, bench.template_overhead(tok), seed=4)
    assert other.read_text() != path.read_text()


def test_too_short_rows_are_refused(tmp_path):
    bench, tok = _script(), bytes_tokenizer()
    with pytest.raises(SystemExit, match="too short"):
        bench.write_prefs(tmp_path / "p.jsonl", 2, 40, bench.template_overhead(tok))


def test_reference_comparison_against_its_tolerance():
    bench = _script()
    ref = [[-4000.0, -3990.0], [-3500.0, -3512.0]]
    tol = bench.ref_tolerance("bf16")
    near = [[v * (1 + tol / 2) for v in row] for row in ref]
    far = [[v * (1 + 2 * tol) for v in row] for row in ref]
    ok, bad = bench.compare_ref(near, ref, tol), bench.compare_ref(far, ref, tol)
    assert ok["within_tolerance"] and not bad["within_tolerance"]
    assert ok["max_abs_diff"] == pytest.approx(4000 * tol / 2)
    assert bench.ref_tolerance("fp32") < tol


@pytest.mark.slow
def test_dpo_vs_trl_runs_end_to_end_on_cpu(tmp_path, cache_dir):
    pytest.importorskip("trl")
    bench = _script()
    out = tmp_path / "dpo.json"
    argv = [
        "--size",
        "tiny",
        "--device",
        "cpu",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--seq",
        "128",
        "--batch",
        "2",
    ]
    variants = json.dumps([{"dpo.logp_chunk": 1}])
    bench.main([*argv, "--model_dir", str(tmp_path / "model"), "--out", str(out), "--variants", variants])
    res = json.loads(out.read_text())
    assert "failed" not in res
    assert res["runs"]["ours+0"]["overrides"] == {"dpo.logp_chunk": 1}
    # the variant is a run of its own on the same model and pairs: the same reference log-probs
    chunked, plain = (np.array(res["runs"][k]["ref_logps"]) for k in ("ours+0", "gptoughts"))
    np.testing.assert_allclose(chunked, plain, rtol=1e-5)
    for side in ("gptoughts", "trl", "ours+0"):
        r = res["runs"][side]
        assert r["tokens_per_s"] > 0 and np.isfinite(r["loss"])
        assert np.array(r["ref_logps"]).shape == (2, 2)
    assert res["tokens_per_pair"] == 2 * 128
    ref = res["ref_logps"]
    assert ref["within_tolerance"] and ref["max_rel_diff"] <= bench.ref_tolerance("fp32")
