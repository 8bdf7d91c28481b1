"""The printed plan: which lines a run's settings add, in which order, and how the processes are counted."""

from __future__ import annotations

import pytest

from gptoughts.training.plan import RunPlan

BATCH = {"micro_batch": 2, "grad_accum": 1, "world_size": 1, "block_size": 64, "tokens_per_step": 128,
         "total_steps": 100, "epochs": 0.5, "stop_rule": "max_steps", "warmup_steps": 10, "eval_interval": 0,
         "save_interval": 0}  # fmt: skip
CORPUS = {"files": 3, "bytes": 123_456, "bytes_read": 123_456, "tokens": 120_000}


def _plan(**kw) -> RunPlan:
    base = dict(model="llama/debug", params=1_234_567, params_non_embedding=1_000_000, trainable_params=1_234_567,
                vocab_size=256, block_size=64, corpus=CORPUS, batch=BATCH, memory_gib=None, device_memory_gib=None,
                tokens_per_s=None, speed_basis="", hours=None, out="/tmp/x", resume=None, resolved={}, warnings=[])  # fmt: skip
    return RunPlan(**{**base, **kw})


def _labels(text: str) -> list[str]:
    return [ln.strip().split(":")[0].split(" ")[0] for ln in text.splitlines()]


def test_a_plain_plan_is_six_lines():
    text = _plan().format()
    assert _labels(text) == ["[bold]plan[/bold]", "corpus", "batch", "steps", "memory", "out"], text
    assert "memory: not estimated; time: measured once the run starts" in text
    assert "corpus: 3 file(s), 0.1 MB on disk, read all of it; 120,000 train tokens" in text


def test_every_setting_adds_its_line_in_order():
    resolved = {"parallel": "fsdp", "reshard_after_forward": "True", "pipeline": "2 stages", "optimizer": "adamw",
                "activation_checkpointing": "full", "optimizer_states": "bf16", "cpu_offload": "on",
                "fp8": "True", "fp8_linears": 12, "fp8_fast_accum": "True", "compile": "True",
                "cuda_graphs": "True (why)", "threads": "2 (why)"}  # fmt: skip
    tasks = {"names": ["a", "b"], "examples": [10, 2000], "interval": 100, "how": ""}
    text = _plan(resolved=resolved, tasks=tasks, memory_gib=0.5, device_memory_gib=80, host_memory_gib=3.0,
                 tokens_per_s=12_345.0, speed_basis="measured", hours=0.5, resume="/r", warnings=["w"]).format()  # fmt: skip
    assert _labels(text) == ["[bold]plan[/bold]", "corpus", "batch", "steps", "parallel", "tasks", "pipeline",
                             "optimizer", "activation", "optimizer", "CPU", "fp8", "compile", "memory", "threads",
                             "out", "[yellow]warning"], text  # fmt: skip
    for line in ("  parallel: fsdp; reshard_after_forward True", "  fp8: True, 12 linear layers; fast accumulation",
                 "  compile: True; CUDA graphs (why)", "scored every 100 steps and at the end",
                 "  memory: ~512 MiB peak of 80.0 GiB + ~3.0 GiB of CPU memory (offload); time: ~30 min at ~12,345",
                 "results reproduce at this count (--threads 2)", "  out: /tmp/x (resuming /r)"):  # fmt: skip
        assert line in text, (line, text)


def test_settings_that_are_off_add_no_line():
    resolved = {"activation_checkpointing": "none (why)", "fp8": "False (why)", "compile": "False"}
    assert _labels(_plan(resolved=resolved).format()) == _labels(_plan().format())


@pytest.mark.parametrize(
    "batch, device, factor",
    [
        ({"world_size": 4, "tp": 2}, "cuda", " x 2 data-parallel rank(s) (tensor parallel x2: 4 GPUs) ="),
        ({"world_size": 4, "dp_size": 2}, "cuda", " x 2 data-parallel ="),
        ({"world_size": 4, "dp_size": 4}, "cuda", " x 4 GPUs ="),
        ({"world_size": 4, "dp_size": 0}, "cuda", " x 4 GPUs ="),  # an older run.json: 0 was "all of them"
        ({"world_size": 2, "dp_size": 1}, "cuda", "accumulation 1 = 128"),  # two pipeline stages share a row
        ({"world_size": 4}, "cuda", " x 4 GPUs ="),
        ({"world_size": 4}, "cpu", " x 4 processes ="),
    ],
)
def test_the_batch_counts_processes_by_what_they_share(batch, device, factor):
    text = _plan(batch={**BATCH, **batch}, device_type=device).format()
    line = next(ln for ln in text.splitlines() if ln.startswith("  batch:"))
    assert factor in line, line


@pytest.mark.parametrize(
    ("eval_interval", "save_interval", "said"),
    [
        (10, 50, "eval every 10, checkpoint every 50 and at each new best val loss"),
        (10, 0, "eval every 10, checkpoint at the end and at each new best val loss"),
        (0, 50, "eval at the end, checkpoint every 50"),
    ],
)
def test_the_steps_line_says_a_new_best_is_saved_where_evaluations_find_one(
    eval_interval, save_interval, said
):
    # every evaluation that beats the best saves a checkpoint: the plan had said "every 50" alone
    batch = {**BATCH, "eval_interval": eval_interval, "save_interval": save_interval}
    line = next(ln for ln in _plan(batch=batch).format().splitlines() if "steps:" in ln)
    assert line.endswith(said), line


def test_the_batch_line_of_preference_pairs_counts_their_two_rows():
    # "8 x 256 tokens x accumulation 1 = 4,096 tokens per step": the product did not add up
    batch = {**BATCH, "micro_batch": 8, "block_size": 256, "tokens_per_step": 4096}
    line = next(ln for ln in _plan(batch=batch).format().splitlines() if "batch:" in ln)
    assert "batch: 8 pairs x 2 rows x 256 tokens x accumulation 1 = 4,096 tokens per step" in line, line
