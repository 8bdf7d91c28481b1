"""A dry run's token count for text read with a model's own tokenizer (continued pretraining, or --tokenizer FOLDER):
it guessed from the byte-level BPE's bytes per token, 2.4x off for a small-vocabulary model (80,760 against
197,877); the tokenizer is there before anything is prepared, so it is measured on the corpus's start."""

from __future__ import annotations

import random
import re

from cli_helpers import QUIET_CPU, run_cli


def _tokens(text: str) -> int:
    m = re.search(r"corpus: .*?(≈)?([\d,]+) train tokens(?: \+ ([\d,]+) held out)?", text)
    assert m, text[-1500:]
    return int(m.group(2).replace(",", "")) + int((m.group(3) or "0").replace(",", ""))


def test_a_dry_run_counts_tokens_with_the_models_tokenizer(hf_model, tmp_path, ft_cache, capsys):
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "the", "model", "trains", "on", "text", "quickly"]
    corpus = tmp_path / "text.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000)))
    base = hf_model("llama")
    cmd = ["finetune", "--model", str(base), "--data", str(corpus), "--max_steps", "1", "--block_size", "32",
           "--batch_size", "2", "--out", str(tmp_path / "run"), *QUIET_CPU]  # fmt: skip
    code, dry = run_cli([*cmd, "--dry_run"], capsys)
    assert code == 0 and "estimated: not tokenized yet" in dry, dry[-1500:]
    code, real = run_cli(cmd, capsys)
    assert code == 0, real[-1500:]
    assert abs(_tokens(dry) / _tokens(real) - 1) < 0.05, (_tokens(dry), _tokens(real))
