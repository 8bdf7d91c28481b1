"""``gptoughts estimate`` for every model family and size in the registry (no GPU: meta-device models only)."""

from __future__ import annotations

import json
import math

import pytest

from gptoughts import cli, models
from gptoughts.perf.estimate import estimate

FAMILY_SIZES = [(fam, size) for fam in models.FAMILIES for size in models.list_sizes(fam)]
FAMILIES = list(models.FAMILIES)


@pytest.mark.parametrize(("family", "size"), FAMILY_SIZES)
def test_estimate_is_finite_positive_and_counts_the_model(family, size):
    e = estimate(family, size)
    meta = models.build_model(family, models.model_args(family, size), device="meta")
    assert e.params == meta.num_params()
    assert e.params_non_embedding == meta.num_params(non_embedding=True)
    for field in (
        "weights_gib",
        "gradients_gib",
        "optimizer_gib",
        "autocast_copies_gib",
        "activations_gib",
        "logits_gib",
        "total_gib",
        "flops_per_token",
        "tokens_per_s",
    ):
        value = getattr(e, field)
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (field, value)
    assert e.total_gib >= e.weights_gib + e.optimizer_gib + e.activations_gib
    for mode in ("selective", "full"):
        e = estimate(family, size, activation_checkpointing=mode, residual_dtype="fp32")
        assert math.isfinite(e.total_gib) and e.activations_gib > 0


@pytest.mark.parametrize(("family", "size"), FAMILY_SIZES)
def test_estimate_cli_exits_cleanly(family, size, capsys):
    assert cli.main(["estimate", "--model", family, "--size", size]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Error" not in err
    assert "total" in out and "params" in out


@pytest.mark.parametrize("device", ["cpu", "CPU", "mps"])
def test_estimate_of_a_cpu_points_to_the_dry_run_that_measures_it(device, capsys):
    # A newcomer's finding: `--gpu cpu` gave "unknown GPU" and the list of GPUs, nothing about the way there.
    assert cli.main(["estimate", "--model", "llama", "--size", "125m", "--gpu", device]) == 2
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err and out == ""
    assert "--dry_run" in lines[0] and f"--device {device.lower()}" in lines[0] and "known:" not in lines[0]


def test_estimate_cli_json_for_each_family(capsys):
    for family in FAMILIES:
        assert cli.main(["estimate", "--model", family, "--size", "debug", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["total_gib"] > 0 and out["params"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_activations_scale_with_batch_and_shrink_with_checkpointing(family):
    size = models.list_sizes(family)[1]  # the smallest real size (index 0 is debug)
    acts = {
        m: estimate(family, size, activation_checkpointing=m, batch_size=4).activations_gib
        for m in ("none", "selective", "full")
    }
    assert acts["none"] > acts["selective"] > acts["full"] > 0, acts
    for mode in ("none", "selective", "full"):
        one = estimate(family, size, activation_checkpointing=mode, batch_size=1).activations_gib
        four = estimate(family, size, activation_checkpointing=mode, batch_size=4).activations_gib
        assert four > one
        assert four == pytest.approx(4 * one)
    none = estimate(family, size, batch_size=4)
    full = estimate(family, size, batch_size=4, activation_checkpointing="full")
    assert full.total_gib < none.total_gib


def test_deepseek_activations_follow_the_active_experts_only():
    base = estimate("deepseek", "small").activations_gib
    more_active = estimate("deepseek", "small", {"n_activated_experts": 12}).activations_gib
    more_routed = estimate("deepseek", "small", {"n_routed_experts": 128}).activations_gib
    assert more_active > 1.2 * base  # each active expert holds its tokens' SwiGLU activations
    assert base < more_routed < 1.01 * base  # idle experts hold none (only the router's scores grow)
    # ... while every expert's weights are counted in memory.
    assert (
        estimate("deepseek", "small", {"n_routed_experts": 128}).weights_gib
        > 1.5 * estimate("deepseek", "small").weights_gib
    )


def test_inl_activations_grow_with_integrator_iterations():
    acts = [
        estimate(
            "inl",
            "3b",
            {"n_iterations": k, "integrator_impl": "reference"},
            batch_size=1,
            residual_dtype="fp32",
        ).activations_gib
        for k in (0, 4, 8)
    ]
    assert acts[0] < acts[1] < acts[2]
    assert acts[2] - acts[1] == pytest.approx(
        acts[1] - acts[0], rel=0.05
    )  # linear in K (autograd keeps each step)


# Peaks measured on one H200 (bench/BENCHMARKS.md, "model families at ~1B": per-block compile, bf16 autocast,
# fp32 residual, chunked loss). The estimate must stay within 5% of them.
MEASURED = [
    ("deepseek", "small", 8, 2048, 31.48),
    ("gpt2", "large", 16, 1024, 36.19),
    ("inl", "3b", 2, 2048, 67.15),
    ("llada", "medium", 8, 2048, 38.34),
]


@pytest.mark.parametrize(("family", "size", "batch", "block", "peak_gib"), MEASURED)
def test_estimate_matches_measured_peaks(family, size, batch, block, peak_gib):
    pinned = {  # what the row measured: INL's reference integrator, DeepSeek's reference MoE path
        "inl": {"integrator_impl": "reference"},
        "deepseek": {"moe_combine": "bmm", "moe_permute": "index_put", "moe_w13": "separate"},
    }.get(family)
    e = estimate(family, size, pinned, batch_size=batch, block_size=block, residual_dtype="fp32")
    assert e.total_gib == pytest.approx(peak_gib, rel=0.05)


# Peaks measured on one H200 with bf16 residual, per-block compile, torch 2.11 (bench/BENCHMARKS.md: the INL,
# DeepSeek and checkpointing-mode tables): `gptoughts bench --model F --size S --block_size T --batch_size B
# --activation_checkpointing M`, and the user path's measured micro-batches (vocab 320: `--tokenizer bytes`). The
# rows hold the terms that are easy to get wrong: DeepSeek's hidden combine keeps the k hidden rows, not the k
# expert outputs; selective keeps MLA's outputs and recomputes one block in the backward; compiled full
# checkpointing keeps the rows torch 2.11 saves for DeepSeek's permutation, and every family's rebuilt block holds
# its gradients too; GPT-2's selective policy keeps every addmm output.
MEASURED_BF16 = [
    # family, size, checkpointing, batch, block, vocab, peak GiB, tolerance
    ("deepseek", "small", "none", 8, 2048, None, 28.5, 0.03),
    ("deepseek", "small", "none", 64, 2048, 320, 122.9, 0.03),
    ("deepseek", "small", "selective", 64, 2048, 320, 56.5, 0.03),
    ("deepseek", "small", "full", 64, 2048, None, 46.02, 0.04),
    ("inl", "3b", "none", 2, 2048, None, 48.10, 0.05),
    ("inl", "3b", "selective", 8, 2048, 320, 53.4, 0.05),
    ("inl", "3b", "selective", 27, 2048, 320, 125.2, 0.05),
    ("inl", "3b", "full", 8, 2048, None, 34.89, 0.05),
    ("gpt2", "large", "selective", 16, 1024, None, 25.98, 0.03),
    ("gpt2", "large", "full", 32, 1024, None, 16.33, 0.05),
    ("llada", "medium", "full", 16, 2048, None, 19.13, 0.06),
    ("llama", "1b", "full", 16, 2048, None, 20.12, 0.05),
    ("llama", "3b", "selective", 4, 2048, None, 48.58, 0.05),
    ("llama", "3b", "selective", 8, 2048, None, 62.01, 0.05),
]


@pytest.mark.parametrize(
    ("family", "size", "checkpointing", "batch", "block", "vocab", "peak_gib", "rel"), MEASURED_BF16
)
def test_estimate_matches_measured_bf16_residual_peaks(
    monkeypatch, family, size, checkpointing, batch, block, vocab, peak_gib, rel
):
    from gptoughts.perf import checkpointing as ac

    monkeypatch.setattr(ac, "compile_recomputes_functions", lambda: False)  # the torch that measured them
    e = estimate(
        family,
        size,
        {"vocab_size": vocab} if vocab else None,
        batch_size=batch,
        block_size=block,
        activation_checkpointing=checkpointing,
        residual_dtype="bf16",
    )
    assert e.total_gib == pytest.approx(peak_gib, rel=rel)


def test_a_torch_that_recomputes_functions_keeps_only_the_blocks_inputs(monkeypatch):
    from gptoughts.perf import checkpointing as ac
    from gptoughts.perf.estimate import kept_by_compiled_full

    args = models.model_args("deepseek", "small")
    monkeypatch.setattr(ac, "compile_recomputes_functions", lambda: False)
    assert (
        kept_by_compiled_full("deepseek", args) == 2 * 6 * 1024 * 15
    )  # a [tokens x 6, 1024] bf16 a MoE block
    monkeypatch.setattr(ac, "compile_recomputes_functions", lambda: True)
    assert kept_by_compiled_full("deepseek", args) == 0
    # a torch that keeps more is never estimated lower (debug: fewer kept rows than one rebuilt block)
    fixed = estimate("deepseek", "debug", batch_size=64, activation_checkpointing="full").total_gib
    monkeypatch.setattr(ac, "compile_recomputes_functions", lambda: False)
    assert estimate("deepseek", "debug", batch_size=64, activation_checkpointing="full").total_gib >= fixed


def test_the_estimate_of_a_small_selective_batch_errs_high():
    # At 2 rows the measured peak (32.38 GiB) is the optimizer step's, with no activations beside the gradients;
    # the estimate adds both, so it is high there, never low.
    e = estimate("inl", "3b", batch_size=2, activation_checkpointing="selective", residual_dtype="bf16")
    assert 32.38 <= e.total_gib <= 1.12 * 32.38


def test_muon_state_is_one_buffer_per_hidden_matrix():
    """Muon keeps one fp32 momentum per hidden matrix (AdamW two moments); embeddings, head and norms keep
    AdamW's two: the optimizer state shrinks by 4 bytes per hidden-matrix parameter, no more."""
    import torch

    from gptoughts import models
    from gptoughts.perf.estimate import estimate

    adamw = estimate("llama", "125m", batch_size=1, block_size=256)
    muon = estimate("llama", "125m", batch_size=1, block_size=256, optimizer="muon")
    with torch.device("meta"):
        model = models.build_model("llama", models.model_args("llama", "125m"))
    hidden = models.hidden_matrices(model)
    n_hidden = sum(p.numel() for p in model.parameters() if id(p) in hidden)
    assert 0 < n_hidden < model.num_params()
    assert (adamw.optimizer_gib - muon.optimizer_gib) * 2**30 == pytest.approx(4 * n_hidden)


def test_async_checkpoint_staging_is_one_host_copy_of_each_ranks_weights_and_optimizer_state():
    """Asynchronous sharded checkpoints keep a host copy of each rank's fp32 weights and AdamW moments (12 bytes a
    parameter, split over the FSDP ranks; offloaded runs too, beside the offloaded state itself)."""
    fsdp = estimate("llama", "125m", batch_size=1, block_size=256, num_gpus=2, strategy="fsdp")
    assert fsdp.checkpoint_staging_gib * 2**30 == pytest.approx(12 * fsdp.params / 2)
    off = estimate(
        "llama", "125m", batch_size=1, block_size=256, num_gpus=2, strategy="fsdp", cpu_offload=True
    )
    assert off.checkpoint_staging_gib == pytest.approx(fsdp.checkpoint_staging_gib)


def test_muons_recorded_step_keeps_its_largest_batchs_working_memory():
    """perf.muon_graph: the recorded step's private memory stays between steps, ~15 bytes per parameter of its
    largest batch of matrices (the MLP's w1, w2, w3 of every layer: one batch); nothing for AdamW."""
    from gptoughts.perf.estimate import estimate

    shape = dict(d_model=512, n_layers=12, n_heads=8, n_kv_heads=8, ffn_dim=1408, vocab_size=8192)
    common = dict(batch_size=32, block_size=512, keep_grads=True)
    plain = estimate("llama", "125m", shape, optimizer="muon", **common)
    graphed = estimate("llama", "125m", shape, optimizer="muon", muon_graph=True, **common)
    mlp = 12 * 3 * 512 * 1408
    assert (graphed.total_gib - plain.total_gib) * 2**30 == pytest.approx(15 * mlp)
    adamw = [estimate("llama", "125m", shape, muon_graph=g, **common).total_gib for g in (False, True)]
    assert adamw[0] == adamw[1]


def test_estimate_holds_the_run_to_its_memory_cap(capsys):
    """--gpu_memory_gib caps what the estimate's run may fill, as it caps train's (a newcomer's 24 GiB INL plan read
    "64.56 of 80 on H100 fits"); over the cap, with the layout pinned, it prints train's refusal."""
    pinned = [
        "--activation_checkpointing",
        "selective",
        "--optimizer_states",
        "fp32",
        "--parallel.cpu_offload",
        "false",
    ]
    argv = ["estimate", "--model", "inl", "--size", "3b", "--batch_size", "1", *pinned, "--json"]
    assert cli.main(argv) == 0
    whole = json.loads(capsys.readouterr().out)
    assert cli.main([*argv, "--gpu_memory_gib", "24"]) == 0
    capped = json.loads(capsys.readouterr().out)
    assert whole["gpu_memory_gib"] == 80 and whole["fits"] is True
    assert capped["gpu_memory_gib"] == 24 and capped["fits"] is False
    assert capped["total_gib"] == whole["total_gib"]
    assert cli.main(argv[:-1] + ["--gpu_memory_gib", "24"]) == 0
    text = capsys.readouterr().out
    assert "of 24.0 on H100  DOES NOT FIT" in text and "`gptoughts train` refuses this run: inl/3b" in text
