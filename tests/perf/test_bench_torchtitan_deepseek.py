"""`gptoughts bench --model deepseek --compare torchtitan` on CPU: what the compare changes on our side and what it
refuses (always run), and, where torchtitan is importable (CI does not install it: skipped there), torchtitan's
DeepSeek-V3 built at our shape, its load-balancing hook at work, and a tiny compare of the same model."""

from __future__ import annotations

import sys

import pytest
import torch
from test_perf import BENCH

from gptoughts import cli, models
from gptoughts.config import load_config
from gptoughts.errors import ConfigError, UserError
from gptoughts.tools import bench, bench_torchtitan, bench_torchtitan_deepseek
from gptoughts.training import modeling

DS_BENCH = {**BENCH, "model.family": "deepseek"}


def test_compare_turns_our_sequence_balance_loss_off_and_says_so():
    cfg = load_config("default", DS_BENCH)
    assert (
        models.model_args("deepseek", "debug").seq_aux_loss_coef > 0
    )  # on by default: the case that matters
    aligned, notes = bench_torchtitan.align_ours_with_torchtitan(cfg)
    assert aligned.model.overrides["seq_aux_loss_coef"] == 0.0
    assert len(notes) == 1 and "seq_aux_loss_coef 0" in notes[0]
    assert "seq_aux_loss_coef" not in cfg.model.overrides  # the caller's config is left as it was
    # already off: nothing to change, nothing to say
    off = load_config("default", {**DS_BENCH, "model.seq_aux_loss_coef": 0})
    assert bench_torchtitan.align_ours_with_torchtitan(off)[1] == []


def test_mtp_is_refused_in_one_line_before_our_run(monkeypatch, capsys):
    monkeypatch.setattr(bench, "import_torchtitan", lambda: None)  # the peer is there; its shape is not

    def never(*a, **k):
        raise AssertionError("our model was built before the refusal")

    monkeypatch.setattr(modeling, "build_model", never)
    args = [f"--{k}={v}" for k, v in {**DS_BENCH, "model.mtp_depth": 1}.items()]
    assert cli.main(["bench", *args, "--steps", "1", "--warmup", "0", "--compare", "torchtitan:sdpa"]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "torchtitan's DeepSeek-V3 has no equivalent of model.mtp_depth = 1" in lines[0]
    assert "--model.mtp_depth 0" in lines[0] and "Traceback" not in out + err


def test_its_deepseek_not_loading_is_one_line_before_our_run(monkeypatch, capsys):
    # torchtitan imports (its Llama 3) but its DeepSeek-V3 modules do not, e.g. a torch API they expect
    monkeypatch.setattr(bench, "import_torchtitan", lambda: None)
    monkeypatch.setattr(bench_torchtitan_deepseek, "_DS", None)
    monkeypatch.setitem(sys.modules, "torchtitan.models.deepseek_v3", None)

    def never(*a, **k):
        raise AssertionError("our model was built before the peer's failure was reported")

    monkeypatch.setattr(modeling, "build_model", never)
    args = [f"--{k}={v}" for k, v in DS_BENCH.items()]
    assert cli.main(["bench", *args, "--steps", "1", "--warmup", "0", "--compare", "torchtitan:sdpa"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: torchtitan's DeepSeek-V3 does not load:"), lines


def test_direct_call_with_the_balance_loss_on_is_refused():
    with pytest.raises(ConfigError, match="no equivalent of model.seq_aux_loss_coef"):
        bench_torchtitan.check_torchtitan_shape("deepseek", models.model_args("deepseek", "debug"))


@pytest.fixture
def torchtitan():
    try:
        tt = bench_torchtitan.import_torchtitan()
        bench_torchtitan.import_torchtitan_deepseek()
    except UserError as e:
        pytest.skip(str(e))
    return tt


def _ours_and_its(tt, overrides: dict, block_size: int = 32):
    args = models.model_args("deepseek", "debug", {"seq_aux_loss_coef": 0.0, **overrides})
    cfg = bench_torchtitan.torchtitan_deepseek_config(tt, args, block_size, attention="sdpa")
    with torch.device("meta"):
        return args, models.build_model("deepseek", args, device="meta"), cfg.build()


def test_its_model_has_our_options(torchtitan):
    over = dict(
        n_shared_experts=0, n_expert_groups=4, n_limited_groups=2, q_lora_rank=16, tie_embeddings=True,
        score_func="softmax", route_scale=1.5, norm_topk_prob=False, norm_eps=1e-5, bias_update_rate=0.0,
    )  # fmt: skip
    args, ours, its = _ours_and_its(torchtitan, over)
    assert sum(p.numel() for p in its.parameters()) == ours.num_params()
    block = its.layers[str(args.n_dense_layers)]
    r = block.moe.router
    assert (r.num_expert_groups, r.num_limited_groups, r.top_k) == (4, 2, args.n_activated_experts)
    assert (r.score_func, r.route_norm, r.route_scale) == ("softmax", False, 1.5)
    assert block.moe.shared_experts is None and block.moe.load_balance_coeff is None
    assert block.attention.q_lora_rank == 16 and block.attention.kv_norm.eps == 1e-6
    assert block.ffn_norm.eps == 1e-5 and its.tok_embeddings.weight is its.lm_head.weight
    assert type(block.attention.inner_attention).__name__ == "ScaledDotProductAttention"
    dense = its.layers["0"]
    assert not dense.moe_enabled and dense.feed_forward.w1.weight.shape == (
        args.dense_inter_dim,
        args.d_model,
    )


def test_its_load_balancing_hook_moves_the_expert_bias(torchtitan):
    tt, device = torchtitan, torch.device("cpu")
    args = models.model_args("deepseek", "debug", {"seq_aux_loss_coef": 0.0, "bias_update_rate": 0.01})
    peer = bench_torchtitan._peer(
        tt, "deepseek", args, 32, attention="sdpa", fp8=None, fp8_bf16_end_layers=0, compiled=False
    )
    assert peer.register_hooks is not None
    with bench_torchtitan._one_process_group(tt, device) as pdims:
        model, loss_fn, _ = bench_torchtitan._parallelized_model(
            tt, peer, pdims, device, mp="float32", compiled=False, ac=None, dump="", vocab=args.vocab_size
        )
        data = bench_torchtitan.SyntheticBatches(args.vocab_size, 2, 32, device, seed=0)
        step = bench_torchtitan._training_step(
            tt, model, loss_fn, pdims, data, batch_size=2, block_size=32, grad_accum=1, device=device,
            flex=False, cuda_graphs=False, register_hooks=peer.register_hooks,
        )  # fmt: skip
        step()
    moes = [b.moe for b in model.layers.values() if b.moe_enabled]
    assert len(moes) == args.n_moe_layers
    for moe in moes:
        # steps of +-0.01 re-centred to sum 0 (its update): moved after an unbalanced step, then the counts cleared
        bias = moe.expert_bias_E
        assert 0 < bias.abs().max().item() <= 0.02 + 1e-6 and abs(bias.sum().item()) < 1e-6
        assert moe.tokens_per_expert_E.sum().item() == 0


def test_tiny_compare_runs_the_same_model(torchtitan, monkeypatch):
    built = []
    real = modeling.build_model

    def spy(cfg, *a, **k):
        built.append(dict(cfg.model.overrides))
        return real(cfg, *a, **k)

    monkeypatch.setattr(modeling, "build_model", spy)
    r = bench.run_bench(load_config("default", DS_BENCH), steps=1, warmup=1, compare="torchtitan:sdpa")
    assert built == [{"seq_aux_loss_coef": 0.0}]  # our timed model is the peer's: no sequence balance loss
    tt = r["torchtitan"]["sdpa"]
    assert "error" not in tt, tt.get("error")
    assert tt["params"] == r["params"]  # same widths, MLA ranks, experts, shared experts, dense layers, vocab
    assert tt["speedup"] == pytest.approx(r["tokens_per_s"] / tt["tokens_per_s"])
    for part in ("DeepSeekV3Model, sdpa attention", "parallelize_deepseekv3", "MoE load-balancing hook"):
        assert part in tt["label"]
    assert "ours: model.seq_aux_loss_coef 0" in tt["label"]
    text = bench.format_result(r)
    assert f"({r['params']:,} params = ours)" in text
    assert "ours, for the compare: model.seq_aux_loss_coef 0" in text
