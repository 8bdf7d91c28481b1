"""LoRA target names: PEFT refuses a list of which no name matches, but with one right and one wrong (``wq,v_proj``)
it left the wrong one's layers without adapters, silently. A wrong name is refused, and Hugging Face's names of a
native model's layers (what PEFT users type) are translated in the fix."""

from __future__ import annotations

import pytest
from cli_helpers import QUIET_CPU, run_cli
from hf_helpers import sft_rows


@pytest.mark.parametrize(
    ("targets", "said"),
    [
        ("wq,v_proj", "v_proj match no linear layer of this model (Hugging Face's names; this model's are ours: "
                      "--target_modules wq,wv)"),
        ("q_proj,v_proj", "--target_modules wq,wv"),
        ("wq,nope", "nope match no linear layer of this model; its linear layers are named"),
    ],
)  # fmt: skip
def test_a_target_that_matches_no_layer_is_refused_with_the_names(targets, said, hf_model, tmp_path, capsys):
    base, data = hf_model("llama"), sft_rows(tmp_path / "d.jsonl", 8)
    cmd = ["finetune", "--model", str(base), "--data", str(data), "--lora", "--target_modules", targets,
           "--max_steps", "1", "--block_size", "32", "--batch_size", "2", "--out", str(tmp_path / "r"), *QUIET_CPU,
           "--dry_run"]  # fmt: skip
    code, text = run_cli(cmd, capsys)
    assert code == 2 and said in text, text[-1500:]


def test_a_gpt2_style_models_conv1d_layers_are_targets(tmp_path):
    # transformers' GPT-2 writes its projections as Conv1D, which PEFT adapts: named, they are not refused
    import transformers

    from gptoughts.training.setup import _check_lora_targets

    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)
    )
    _check_lora_targets(model, ["c_attn", "c_proj"])
    with pytest.raises(Exception, match="nope match no linear layer"):
        _check_lora_targets(model, ["c_attn", "nope"])
