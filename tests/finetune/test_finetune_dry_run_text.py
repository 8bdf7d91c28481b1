"""A dry run of continued pretraining (`gptoughts finetune --model HF_DIR --data notes.txt --dry_run`) on a small
text: the tokenizer is the model's own, so the plan does not warn of a BPE trained on the corpus."""

from __future__ import annotations

from cli_helpers import QUIET_CPU, run_cli


def test_a_fine_tuning_dry_run_on_a_small_text_warns_of_no_bpe(hf_model, tmp_path, ft_cache, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("the cat sat on the mat\n" * 200)  # 4.6 KB: under 64 bytes per token of the model's 320
    base = hf_model("llama")
    code, text = run_cli(
        ["finetune", "--model", str(base), "--data", str(notes), "--out", str(tmp_path / "run"), "--dry_run",
         *QUIET_CPU],
        capsys,
    )  # fmt: skip
    assert code == 0 and text.startswith("plan: llama from"), text[-2000:]
    assert "BPE" not in text, text
