"""CPU tests of the speed tooling: bench fields, estimate consistency, auto batch size, fp8 refusal, timing."""

from __future__ import annotations

import json
import os

import pytest
import torch

from gptoughts import cli
from gptoughts.config import load_config
from gptoughts.errors import HardwareError, UserError
from gptoughts.perf import autobatch
from gptoughts.perf.estimate import estimate
from gptoughts.perf.timing import StepTimer, advice

BENCH = {
    "model.size": "debug",
    "train.block_size": 32,
    "train.batch_size": 2,
    "perf.device": "cpu",
    "perf.precision": "fp32",
    "perf.compile": False,
}


def test_bench_debug_returns_every_field():
    from gptoughts.tools.bench import format_result, run_bench

    r = run_bench(load_config("default", BENCH), steps=2, warmup=1, compare="hf", hf_modes=("eager",))
    for key in (
        "tokens_per_s",
        "step_ms",
        "mfu",
        "peak_memory_gib",
        "breakdown",
        "params",
        "flops_per_token",
        "resolved",
        "hf",
    ):
        assert key in r, key
    assert r["tokens_per_s"] > 0 and r["step_ms"] > 0
    assert r["mfu"] is None  # no known peak FLOP/s on a CPU: MFU is not invented
    b = r["breakdown"]
    for phase in ("data", "forward", "backward", "optimizer"):
        assert b[f"time/{phase}_ms"] >= 0
    assert b["time/forward_ms"] > 0 and b["time/backward_ms"] > 0
    assert (
        abs(sum(b[f"time/{p}_pct"] for p in ("data", "forward", "backward", "optimizer", "other")) - 100)
        < 1e-6
    )
    hf = r["hf"]["eager"]
    assert hf["tokens_per_s"] > 0 and hf["speedup"] == pytest.approx(r["tokens_per_s"] / hf["tokens_per_s"])
    assert "transformers eager" in format_result(r)


def test_bench_cli_json(capsys):
    args = [f"--{k}={v}" for k, v in BENCH.items()]
    assert cli.main(["bench", *args, "--steps", "1", "--warmup", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["batch_size"] == 2 and out["block_size"] == 32


@pytest.mark.parametrize("size", ["125m", "1b", "3b"])
def test_estimate_activations_shrink_with_checkpointing_and_scale_with_batch(size):
    acts = {
        m: estimate("llama", size, activation_checkpointing=m, batch_size=4).activations_gib
        for m in ("none", "selective", "full")
    }
    assert acts["none"] > acts["selective"] > acts["full"] > 0
    for mode in ("none", "selective", "full"):
        one = estimate("llama", size, activation_checkpointing=mode, batch_size=1).activations_gib
        four = estimate("llama", size, activation_checkpointing=mode, batch_size=4).activations_gib
        assert four == pytest.approx(4 * one)
    e = estimate("llama", size, batch_size=4)
    assert e.weights_gib == pytest.approx(e.params * 4 / 2**30)
    assert e.optimizer_gib == pytest.approx(2 * e.weights_gib)
    assert e.total_gib >= e.weights_gib + e.optimizer_gib + max(e.activations_gib, e.gradients_gib) - 1e-9


def test_estimate_time_and_cost():
    e = estimate("llama", "1b", gpu="H100", tokens=10**9, mfu=0.5, price=2.0)
    expected_tps = 989e12 * 0.5 / e.flops_per_token
    assert e.tokens_per_s == pytest.approx(expected_tps)
    assert e.hours == pytest.approx(1e9 / expected_tps / 3600)
    assert e.cost == pytest.approx(e.hours * 2.0)
    with pytest.raises(UserError, match="unknown GPU"):
        estimate("llama", "1b", gpu="Voodoo2")


def test_estimate_fsdp_shards_the_training_state_across_gpus():
    ddp = estimate("llama", "3b", batch_size=4, gpu="H100", num_gpus=4)
    fsdp = estimate("llama", "3b", batch_size=4, gpu="H100", num_gpus=4, strategy="fsdp")
    for k in ("weights_gib", "gradients_gib", "optimizer_gib"):
        assert getattr(fsdp, k) == pytest.approx(getattr(ddp, k) / 4)
    assert fsdp.activations_gib == ddp.activations_gib
    # gathered at a time: a few blocks and the root, far less than autocast's copy of every matmul weight
    assert 0 < fsdp.autocast_copies_gib < ddp.autocast_copies_gib / 4
    assert fsdp.total_gib < ddp.total_gib - 20
    one = estimate("llama", "3b", batch_size=4, gpu="H100", num_gpus=1, strategy="fsdp")
    assert one.total_gib == pytest.approx(estimate("llama", "3b", batch_size=4, gpu="H100").total_gib)
    with pytest.raises(UserError, match="strategy"):
        estimate("llama", "3b", strategy="zero3")


def test_estimate_cli(capsys):
    assert cli.main(["estimate", "--size", "125m", "--tokens", "1e9", "--gpu", "A100", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["gpu"] == "A100" and d["hours"] > 0 and d["cost"] > 0


class FakeMemory:
    """A device that holds `limit` sequences: more raises OOM; peak grows with the batch."""

    def __init__(self, limit: int):
        self.limit = limit
        self.calls: list[int] = []
        self.last = 0

    def step(self, batch: int) -> None:
        self.calls.append(batch)
        self.last = batch
        if batch > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (fake)")

    def peak(self) -> int:
        return self.last * 100


@pytest.mark.parametrize("limit", [1, 5, 37, 64, 200])
def test_autobatch_search_finds_the_largest_fitting_batch(limit):
    fake = FakeMemory(limit)
    fits = autobatch.make_fits(fake.step, torch.device("cpu"), capacity=None, peak=fake.peak)
    assert autobatch.search(fits, max_batch=256) == limit
    assert len(fake.calls) <= 2 * 9 + 1  # doubling then bisection, not a linear scan


def test_autobatch_safety_margin_and_cache(tmp_path):
    fake = FakeMemory(1000)
    cache = autobatch.BatchCache(tmp_path / "ab.json")
    parts = {"model": "x", "block": 128, "gpu": "fake"}
    # capacity 1000 "bytes", peak = 100 * batch, margin 0.9 -> the largest batch under 900 is 9
    best, cached = autobatch.find_batch_size(
        fake.step, torch.device("cpu"), parts=parts, cache=cache, capacity=1000, peak=fake.peak, safety=0.9
    )
    assert (best, cached) == (9, False)
    n = len(fake.calls)
    best2, cached2 = autobatch.find_batch_size(
        fake.step, torch.device("cpu"), parts=parts, cache=cache, capacity=1000, peak=fake.peak
    )
    assert (best2, cached2) == (9, True) and len(fake.calls) == n  # no new tries
    other, cached3 = autobatch.find_batch_size(
        fake.step,
        torch.device("cpu"),
        parts={**parts, "block": 256},
        cache=cache,
        capacity=1000,
        peak=fake.peak,
    )
    assert not cached3


def test_autobatch_nothing_fits_is_a_clear_error(tmp_path):
    fake = FakeMemory(0)
    with pytest.raises(autobatch.NothingFits, match="not even one row fits.*--parallel.cpu_offload true"):
        autobatch.find_batch_size(
            fake.step,
            torch.device("cpu"),
            parts={"k": 1},
            cache=autobatch.BatchCache(tmp_path / "c.json"),
            peak=fake.peak,
        )


def test_autobatch_other_errors_propagate():
    def broken(batch: int) -> None:
        raise ValueError("a bug, not memory")

    fits = autobatch.make_fits(broken, torch.device("cpu"))
    with pytest.raises(ValueError):
        fits(1)


def test_accumulation_for_global_batch():
    assert autobatch.accumulation_for(524288, 8, 2048, 1) == 32
    assert autobatch.accumulation_for(524288, 8, 2048, 4) == 8
    assert autobatch.accumulation_for(None, 8, 2048, 1) == 1


def test_fp8_refused_on_cpu():
    from gptoughts.perf.fp8 import check_fp8_supported

    with pytest.raises(HardwareError, match="fp8"):
        check_fp8_supported(torch.device("cpu"))


def test_fp8_refused_through_the_cli(tmp_path, text_corpus, cache_dir, fast, capsys):
    args = [f"--{k}={v}" for k, v in fast.items() if k != "train.sample_prompts"]
    code = cli.main(
        [
            "train",
            "default",
            "--data",
            str(text_corpus),
            "--out",
            str(tmp_path / "r"),
            "--max_steps",
            "1",
            "--fp8",
            *args,
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "fp8" in err and "Traceback" not in err
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_fp8_filter_skips_head_router_and_odd_dims():
    from torch import nn

    from gptoughts.perf.fp8 import fp8_module_filter

    assert fp8_module_filter(nn.Linear(64, 128), "layers.0.attention.wq")
    assert not fp8_module_filter(nn.Linear(64, 128), "output")
    assert not fp8_module_filter(nn.Linear(64, 8), "layers.1.moe.gate")
    assert not fp8_module_filter(nn.Linear(64, 100), "layers.0.feed_forward.w1")
    assert not fp8_module_filter(nn.Embedding(10, 16), "tok_embeddings")
    # first and last block kept in bf16 on request
    lin = nn.Linear(64, 128)
    picked = [i for i in range(6) if fp8_module_filter(lin, f"layers.{i}.attention.wq", 6, 1)]
    assert picked == [1, 2, 3, 4]
    assert [i for i in range(6) if fp8_module_filter(lin, f"layers.{i}.feed_forward.w2", 6, 0)] == list(
        range(6)
    )


@pytest.mark.parametrize("fast", [False, True])
def test_fp8_fast_accum_reaches_the_backward_matmuls(fast):
    from torch import nn

    pytest.importorskip("torchao.float8")
    from gptoughts.perf.fp8 import convert_to_fp8

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.ModuleDict({"wq": nn.Linear(32, 64)}) for _ in range(2)])
            self.output = nn.Linear(32, 100)

    m = M()
    assert convert_to_fp8(m, "tensorwise", fast_accum=fast) == 2
    cfg = m.layers[0]["wq"].config
    assert cfg.gemm_config_output.use_fast_accum  # torchao's forward default either way
    assert cfg.gemm_config_grad_input.use_fast_accum is fast
    assert cfg.gemm_config_grad_weight.use_fast_accum is fast
    assert type(m.output) is nn.Linear


def test_step_timer_and_advice():
    t = StepTimer(torch.device("cpu"))
    for _ in range(3):
        t.start()
        t.mark("data")
        t.mark("forward")
        t.mark("backward")
        t.mark("optimizer")
        t.stop()
    s = t.summary()
    assert set(s) >= {"time/step_ms", "time/data_pct", "time/forward_ms"}
    assert t.summary() == {}  # read once
    tips = advice({"time/data_pct": 12.0}, {"gpu/util_pct": 60.0})
    assert len(tips) == 2 and "data wait" in tips[0] and "utilisation" in tips[1]
    assert advice({"time/data_pct": 1.0}, {"gpu/util_pct": 97.0}) == []
    # with the window before's reading: low utilisation counts only when both windows were low
    low, high = {"gpu/util_pct": 37.0}, {"gpu/util_pct": 100.0}
    assert advice({}, low, high) == []  # one window holding a compile or an evaluation
    assert advice({}, low, {}) == []  # no reading before (the first window)
    assert len(advice({}, low, {"gpu/util_pct": 50.0})) == 1


def test_activation_checkpointing_keeps_gradients_and_keys():
    from gptoughts import models
    from gptoughts.perf.checkpointing import apply_activation_checkpointing

    x = torch.randint(0, 512, (2, 16))
    grads = {}
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        m = models.build_model("llama", models.model_args("llama", "debug", {}))
        keys = set(m.state_dict())
        apply_activation_checkpointing(m, mode)
        assert set(m.state_dict()) == keys
        m(x).float().logsumexp(-1).sum().backward()
        grads[mode] = torch.cat([p.grad.flatten() for p in m.parameters()])
    assert torch.allclose(grads["none"], grads["selective"], atol=1e-6)
    assert torch.allclose(grads["none"], grads["full"], atol=1e-6)


def test_activation_checkpointing_replays_the_dropout_masks_of_lora():
    """LoRA's adapter dropout under recomputation (eager): the gradients follow the forward's masks."""
    from gptoughts import models
    from gptoughts.config import LoraConfig
    from gptoughts.perf.checkpointing import _draws_randomness, apply_activation_checkpointing
    from gptoughts.training.setup import apply_lora

    def lora_model(dropout: float) -> torch.nn.Module:
        torch.manual_seed(0)
        base = models.build_model("llama", models.model_args("llama", "debug", {}))
        assert not _draws_randomness(base)  # ours draw none: no RNG state copies for them
        m = apply_lora(base, LoraConfig(enabled=True, dropout=dropout), device=torch.device("cpu"))
        for name, p in m.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero, which leaves A's gradient (it reads the mask) zero
                torch.nn.init.normal_(p, std=0.02)
        return m

    assert not _draws_randomness(lora_model(0.0))  # no dropout: the measured LoRA path is unchanged
    torch.manual_seed(2)
    x = torch.randint(0, 512, (2, 16))
    grads = {}
    for mode in ("none", "selective", "full"):
        m = lora_model(0.5)
        assert _draws_randomness(m)
        apply_activation_checkpointing(m, mode)
        torch.manual_seed(1)
        m(x).float().logsumexp(-1).sum().backward()
        grads[mode] = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
    assert grads["none"].abs().sum() > 0
    assert torch.allclose(grads["none"], grads["selective"], atol=1e-6)
    assert torch.allclose(grads["none"], grads["full"], atol=1e-6)


@pytest.mark.slow
def test_tune_table_and_winner(tmp_path):
    from gptoughts.tools.tune import best, format_table, run_tune, write_winner

    cfg = load_config("default", BENCH)
    trials = run_tune(cfg, steps=1, warmup=1)
    assert {t.settings["perf.activation_checkpointing"] for t in trials} == {"none", "selective", "full"}
    assert all(t.tokens_per_s and t.tokens_per_s > 0 for t in trials)
    win = best(trials)
    assert win is not None and win.tokens_per_s == max(t.tokens_per_s for t in trials)
    table = format_table(trials)
    assert "<- best" in table and table.count("\n") == len(trials) + 1
    path = write_winner(win, cfg, tmp_path / "tuned.toml")
    tuned = load_config(str(path))
    assert tuned.perf.activation_checkpointing == win.settings["perf.activation_checkpointing"]
    assert tuned.model.size == "debug" and tuned.train.block_size == 32


@pytest.mark.parametrize("frozen_head", [False, True])
def test_chunked_ce_matches_plain(frozen_head):
    from gptoughts.perf.ce import chunked_linear_ce, plain_linear_ce

    torch.manual_seed(0)
    h = torch.randn(2, 50, 16, requires_grad=True)
    w = torch.randn(97, 16, requires_grad=not frozen_head)
    t = torch.randint(0, 97, (2, 50))
    t[0, :7] = -100  # ignored targets (prompt tokens in SFT)
    ref = plain_linear_ce(h, w, t)
    ref.backward()
    gh, gw = h.grad.clone(), (w.grad.clone() if w.grad is not None else None)
    h.grad = None
    w.grad = None
    out = chunked_linear_ce(h, w, t, chunk_size=32)  # 100 rows: chunks of 32, 32, 32, 4
    (out * 3).backward()
    assert out.item() == pytest.approx(ref.item(), rel=1e-5)
    assert torch.allclose(h.grad / 3, gh, atol=1e-5)
    if frozen_head:
        assert w.grad is None
    else:
        assert torch.allclose(w.grad / 3, gw, atol=1e-5)


def test_fused_and_eager_ce_logit_gradients_agree():
    from gptoughts.perf.ce import ce_logit_grad

    torch.manual_seed(0)
    logits = torch.randn(6, 11)
    lse = torch.logsumexp(logits, -1)
    t = torch.tensor([0, 3, 10, 5, 0, 7])
    scale = torch.tensor([1.0, 0.0, 2.5, 1.0, 1.0, 0.5])  # an ignored row and weighted rows
    fused = ce_logit_grad(logits, lse, t, scale, fused=True)
    eager = ce_logit_grad(logits.clone(), lse, t, scale, fused=False)
    assert torch.allclose(fused, eager, atol=1e-6)
    ref = (torch.softmax(logits, -1) - torch.nn.functional.one_hot(t, 11)) * scale[:, None]
    assert torch.allclose(fused, ref, atol=1e-6)
    assert fused[1].abs().max() == 0


def test_kernel_categories_and_summary():
    from gptoughts.perf.timing import format_kernels, kernel_category, summarize_kernels

    names = {
        "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_TNT": "matmul",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64": "matmul",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3": "attention",
        "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*)": "attention",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>": "attention",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
        "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0": "elementwise",
        "triton_tem_fused_mm_0": "matmul",
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL": "communication",
        "Memcpy DtoD (Device -> Device)": "memcpy",
        "some_unknown_kernel": "other",
    }
    for name, cat in names.items():
        assert kernel_category(name) == cat, name
    us = {
        "nvjet_a": 3000.0,
        "nvjet_b": 1000.0,
        "flash_fwd": 2000.0,
        "triton_poi_fused_add_0": 1000.0,
        "multi_tensor_apply_kernel": 1000.0,
    }
    s = summarize_kernels(us, steps=2)
    assert s["gpu_busy_ms_per_step"] == pytest.approx(4.0)  # 8000 us over 2 steps
    cats = s["categories"]
    assert list(cats)[0] == "matmul" and cats["matmul"]["ms_per_step"] == pytest.approx(2.0)
    assert cats["matmul"]["pct"] == pytest.approx(50.0)
    assert sum(c["pct"] for c in cats.values()) == pytest.approx(100.0)
    assert s["top_kernels"][0]["name"] == "nvjet_a"
    assert format_kernels(s).startswith("GPU busy 4.0 ms/step: matmul 2.0 ms (50%)")


@pytest.mark.parametrize("residual", ["fp32", "bf16"])
def test_residual_dtype_switch(residual):
    from gptoughts import models
    from gptoughts.training.setup import set_residual_dtype

    torch.manual_seed(0)
    m = models.build_model("llama", models.model_args("llama", "debug", {}))
    assert set_residual_dtype(m, residual) == (1 if residual == "bf16" else 0)
    seen = []
    m.layers[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
    x = torch.randint(0, 512, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(x, return_hidden=True)
    assert seen[-1] == (torch.bfloat16 if residual == "bf16" else torch.float32)
    out.float().sum().backward()  # gradients flow back through the cast into the fp32 embedding table
    assert m.tok_embeddings.weight.grad is not None and m.tok_embeddings.weight.grad.dtype == torch.float32
    m(x)  # outside autocast the hook is a no-op
    assert seen[-1] == torch.float32


def test_compile_modes_and_their_validation():
    from gptoughts.errors import ConfigError
    from gptoughts.training.resolve import inductor_mode

    perf = load_config("default", {"perf.cuda_graphs": True}).perf
    assert inductor_mode(perf) == "reduce-overhead"
    perf = load_config("default", {"perf.max_autotune": True}).perf
    assert inductor_mode(perf) == "max-autotune-no-cudagraphs"
    assert inductor_mode(load_config("default", {}).perf) is None
    with pytest.raises(ConfigError, match="precision"):
        load_config("default", {"perf.residual_dtype": "bf16", "perf.precision": "fp16"})
    with pytest.raises(ConfigError, match="compile"):
        from gptoughts.tools.bench import run_bench

        run_bench(load_config("default", {**BENCH, "perf.cuda_graphs": True}), steps=1, warmup=0)


def test_cuda_graphs_auto_is_on_for_lora_on_a_llama_base_in_one_cuda_process_only():
    from types import SimpleNamespace

    from gptoughts.config import LoraConfig
    from gptoughts.errors import ConfigError
    from gptoughts.training.resolve import cuda_graphs_rule

    auto = load_config("default", {}).perf
    assert auto.cuda_graphs == "auto"
    lora, one = LoraConfig(enabled=True), SimpleNamespace(enabled=False, sharded=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    on, why = cuda_graphs_rule(auto, True, "llama", lora, one, cuda)
    assert on and why.startswith("auto: LoRA")
    off = [
        (False, "llama", lora, one, cuda),  # not compiled
        (True, "llama", lora, one, cpu),
        (True, "deepseek", lora, one, cuda),  # other families: not measured
        (True, "llama", None, one, cuda),  # pretraining: long steps, no gain (session 10)
        (True, "llama", LoraConfig(enabled=True, quantize="4bit"), one, cuda),
        (True, "llama", lora, SimpleNamespace(enabled=True, sharded=False), cuda),
        (True, "llama", lora, one, cuda, "fp16"),  # the loss scaler was not measured with graphs
        (
            True,
            "llama",
            lora,
            one,
            cuda,
            "bf16",
            True,
        ),  # --batch_size auto: its probe under graphs, not measured
    ]
    for args in off:
        assert cuda_graphs_rule(auto, *args) == (False, "auto"), args
    asked = load_config("default", {"perf.cuda_graphs": False}).perf
    assert cuda_graphs_rule(asked, True, "llama", lora, one, cuda) == (False, "asked")
    with pytest.raises(ConfigError, match="cuda_graphs must be true, false or auto"):
        load_config("default", {"perf.cuda_graphs": "maybe"})


def test_gpu_idle_gaps_between_kernels():
    from gptoughts.perf.timing import summarize_gaps

    # two steps: kernels a,b back to back, a 500 us gap before c, an overlapping kernel d inside c, 10 us gap
    iv = [
        (0.0, 100.0, "a"),
        (100.0, 200.0, "b"),
        (700.0, 900.0, "c"),
        (750.0, 800.0, "d"),
        (910.0, 950.0, "e"),
    ]
    s = summarize_gaps(iv, steps=2, min_us=20.0)
    assert s["idle_ms_per_step"] == pytest.approx((500.0 + 10.0) / 1e3 / 2)
    assert s["gaps_over_min"] == 1
    assert s["largest"][0] == {"us": 500.0, "after": "b", "before": "c"}
    assert summarize_gaps([], steps=1)["idle_ms_per_step"] == 0.0


@pytest.mark.parametrize(
    "arch,bf16,expected",
    [("hopper", True, "bf16"), ("ampere", True, "bf16"), ("older", False, "fp32"), ("cpu", True, "fp32")],
)
def test_hardware_profile_recommends_the_residual_dtype(arch, bf16, expected):
    from gptoughts.perf.hardware import HardwareProfile, recommend

    p = HardwareProfile(
        device="cuda:0" if arch != "cpu" else "cpu",
        name="x",
        arch=arch,
        compute_capability=None,
        memory_bytes=None,
        gpu_count=1,
        cpu_count=2,
        peak_bf16_flops=None,
        bf16=bf16,
        fp16=True,
        fp8=arch == "hopper",
        compile=True,
    )
    rec = recommend(p)
    assert rec["residual_dtype"] == expected
    assert rec["precision"] == ("fp32" if arch == "cpu" else "bf16" if bf16 else "fp16")


def test_summarize_profile_from_profiler_events():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from gptoughts.perf.timing import summarize_profile

    def ev(start, end, name, dev=DeviceType.CUDA):
        return SimpleNamespace(device_type=dev, time_range=SimpleNamespace(start=start, end=end), name=name)

    annotation = ev(0, 700, "## Call CompiledFxGraph abc ##")
    annotation.is_user_annotation = True
    prof = SimpleNamespace(
        events=lambda: [
            ev(0, 300, "nvjet_x"),
            ev(400, 500, "triton_poi_fused_add"),
            ev(0, 1000, "aten::mm", DeviceType.CPU),
            ev(500, 600, "nvjet_x"),
            annotation,
            ev(0, 650, "Optimizer.step#AdamW.step"),
        ]
    )
    s = summarize_profile(prof, steps=1)
    assert s["categories"]["matmul"]["ms_per_step"] == pytest.approx(0.4)
    assert s["categories"]["elementwise"]["ms_per_step"] == pytest.approx(0.1)
    assert s["gaps"]["idle_ms_per_step"] == pytest.approx(0.1)  # 300 -> 400 us
    assert summarize_profile(SimpleNamespace(events=lambda: [ev(0, 5, "cpu op", DeviceType.CPU)]), 1) == {}
    from gptoughts.perf.timing import format_profile

    lines = format_profile(s)
    assert (
        len(lines) == 2
        and lines[0].startswith("kernels: GPU busy")
        and lines[1].startswith("GPU idle 0.10 ms")
    )


def test_compile_caches_live_beside_the_token_cache(tmp_path, monkeypatch):
    """torch.compile's caches go to $GPTOUGHTS_CACHE/inductor (torch's /tmp default counts as unset, since
    torch writes it into the variable when it first looks); a user's own choice is kept."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from gptoughts.training.environment import use_our_compile_cache

    monkeypatch.setenv("GPTOUGHTS_CACHE", str(tmp_path / "cache"))
    for before, after in (
        (None, tmp_path / "cache" / "inductor"),
        (default_cache_dir(), tmp_path / "cache" / "inductor"),
        (str(tmp_path / "mine"), tmp_path / "mine"),
    ):
        if before is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", before)
        use_our_compile_cache()
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(after)


def test_startup_line_names_a_python_without_bytecode_caches(monkeypatch, cache_dir):
    """A slow start-up in a Python that writes no .pyc (PYTHONDONTWRITEBYTECODE) gets a hint (one short line, once:
    tests/training/test_seams_plan.py); a fast one, or a Python with caches, none."""
    import sys
    from types import SimpleNamespace

    from gptoughts.perf.startup import Startup

    slow = Startup(imports_s=4.0, assembly_s=3.0, first_step_s=2.0)
    fast = Startup(imports_s=1.0, assembly_s=1.0, first_step_s=1.0)
    monkeypatch.setattr(sys, "flags", SimpleNamespace(dont_write_bytecode=0))
    assert slow.bytecode_hint() == ""
    monkeypatch.setattr(sys, "flags", SimpleNamespace(dont_write_bytecode=1))
    assert slow.line().startswith("first step done 9.0 s after the command")
    assert fast.bytecode_hint() == ""
    assert "PYTHONDONTWRITEBYTECODE" in slow.bytecode_hint()


def test_estimate_under_accumulation_holds_the_gradients_beside_the_activations():
    """Without accumulation the peak is the larger of the gradients (at the optimizer step) and the backward's
    working set; with it, the gradients of the micro-batches before live through the next one's backward: both."""
    one = estimate("llama", "1b", batch_size=8, block_size=2048)
    acc = estimate("llama", "1b", batch_size=8, block_size=2048, grad_accum=4)
    base = one.weights_gib + one.optimizer_gib
    work = one.autocast_copies_gib + one.logits_gib + one.activations_gib
    assert abs(one.total_gib - (base + max(one.gradients_gib, work))) < 1e-6
    assert abs(acc.total_gib - (base + one.gradients_gib + work)) < 1e-6
    assert acc.total_gib > one.total_gib
    # CUDA graphs keep the gradients allocated between steps: the same sum without accumulation
    kept = estimate("llama", "1b", batch_size=8, block_size=2048, keep_grads=True)
    assert abs(kept.total_gib - acc.total_gib) < 1e-6


def test_gptoughts_estimate_keeps_a_given_accumulation_under_an_automatic_batch():
    """`gptoughts estimate --grad_accum 1` with the automatic batch: the accumulation train would use (the user's,
    not the global batch's), and its memory (no gradients beside the activations)."""
    from gptoughts.perf.estimate import estimate_config

    cfg = load_config(None, {"model.size": "1b", "train.batch_size": "auto", "train.grad_accum": 1})
    e, micro, accum = estimate_config(cfg)
    assert accum == 1
    single = estimate("llama", "1b", {"vocab_size": cfg.model.overrides.get("vocab_size", 32768)},
                      batch_size=micro, block_size=cfg.train.block_size)  # fmt: skip
    assert abs(e.total_gib - single.total_gib) < 1e-6
    auto = load_config(None, {"model.size": "1b", "train.batch_size": "auto"})
    assert estimate_config(auto)[2] > 1  # the size's global batch: accumulated


def test_the_plans_estimate_knows_an_automatic_batchs_accumulation():
    """Before the batch is planned, an automatic batch's accumulation is what reaching the global batch takes (as
    plan_batches sets it); a given batch keeps the config's."""
    from gptoughts.training.estimates import accumulation

    auto = load_config(
        "default",
        {"train.batch_size": "auto", "train.global_batch_tokens": 1 << 20, "train.block_size": 2048},
    )
    assert auto.train.batch_size == "auto"
    assert accumulation(auto, 16, 2048, 1) == 32 and accumulation(auto, 16, 2048, 4) == 8
    assert accumulation(auto, 1024, 2048, 1) == 1
    given = load_config("default", {"train.batch_size": 4, "train.grad_accum": 3})
    assert accumulation(given, 4, 2048, 1) == 3
