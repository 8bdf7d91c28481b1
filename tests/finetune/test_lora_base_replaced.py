"""LoRA adapters fit the weights they were trained over. A base folder replaced by another revision at the same path
(a re-download, a re-export) was taken silently by a resume, `sample` and `export`: another model. The run records
its base's files; a changed base is refused in one line."""

from __future__ import annotations

import transformers
from cli_helpers import QUIET_CPU, run_cli
from hf_helpers import randomize, sft_rows


def test_adapters_over_a_replaced_base_are_refused(hf_model, tmp_path, ft_cache, capsys):
    base, data, out = hf_model("llama"), sft_rows(tmp_path / "d.jsonl", 8), tmp_path / "ft"
    cmd = ["finetune", "--model", str(base), "--data", str(data), "--lora", "--max_steps", "1", "--block_size", "32",
           "--batch_size", "2", "--out", str(out), *QUIET_CPU]  # fmt: skip
    assert run_cli(cmd, capsys)[0] == 0
    # the same base again, bit for bit (same files, new mtimes): still its base
    code, text = run_cli(
        ["sample", str(out), "--prompt", "hi", "--max_new_tokens", "2", "--device", "cpu"], capsys
    )
    assert code == 0, text[-1500:]
    model = transformers.LlamaForCausalLM.from_pretrained(str(base))
    randomize(model, seed=8)  # another revision of the same architecture: same file sizes
    model.save_pretrained(str(base))
    said = f"{out} was trained on top of {base} as it was then, and its files have changed since"
    for argv in (
        ["finetune", "--resume", "auto", "--out", str(out), "--max_steps", "2", *QUIET_CPU],
        [
            "finetune",
            "--model",
            str(base),
            "--resume",
            "auto",
            "--out",
            str(out),
            "--max_steps",
            "2",
            *QUIET_CPU,
        ],
        ["sample", str(out), "--prompt", "hi", "--max_new_tokens", "2", "--device", "cpu"],
        ["export", str(out), str(tmp_path / "exported")],
    ):
        code, text = run_cli(argv, capsys)
        assert code == 2 and said in text, (argv[0], text[-1500:])
    assert not (tmp_path / "exported").exists()
