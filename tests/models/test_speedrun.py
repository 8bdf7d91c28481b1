"""The speedrun switches of the Llama family (qk_norm, mlp = relu2, zero_init_output / zero_init_proj,
logit_softcap) and the ``llama-125m-speedrun`` preset: each switch does what its docstring says, the soft-cap
reaches every path that makes logits (plain and chunked losses, the objective, sampling), export maps or refuses
them, and with every switch off the model is the one it was."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from gptoughts import api
from gptoughts.config import load_config
from gptoughts.errors import ConfigError, UserError
from gptoughts.models import build_model, model_args
from gptoughts.models.llama import ReLU2MLP
from gptoughts.perf import ce
from gptoughts.perf.ce import chunked_linear_ce, make_loss, plain_linear_ce
from gptoughts.perf.estimate import _layer_activation_bytes
from gptoughts.training.objectives import CausalLM

OFF = dict(qk_norm=False, mlp="swiglu", zero_init_output=False, zero_init_proj=False, logit_softcap=None)
ON = dict(qk_norm=True, mlp="relu2", zero_init_output=True, zero_init_proj=True, logit_softcap=15.0)


def _model(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return build_model("llama", model_args("llama", "debug", overrides), device="cpu").eval()


def _ids(b: int = 2, t: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 512, (b, t), generator=torch.Generator().manual_seed(seed))


def _perturb(model: torch.nn.Module, seed: int = 3) -> None:
    """Zero-initialised matrices would hide a mistake: give every parameter random values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))


def test_switches_off_are_the_model_of_before():
    base, off = _model(), _model(**OFF)
    assert base.state_dict().keys() == off.state_dict().keys()
    for k, v in base.state_dict().items():
        assert torch.equal(v, off.state_dict()[k]), k
    ids = _ids()
    assert torch.equal(base(ids), off(ids))
    assert not any("q_norm" in k for k in base.state_dict())
    assert "layers.0.feed_forward.w1.weight" in base.state_dict()


def test_qk_norm_adds_per_head_norms_of_unit_rms():
    plain, normed = _model(), _model(qk_norm=True)
    a = normed.args
    assert normed.num_params() - plain.num_params() == 2 * a.hd * a.n_layers
    seen = []
    for layer in normed.layers:
        for norm in (layer.attention.q_norm, layer.attention.k_norm):
            norm.register_forward_hook(lambda m, i, o: seen.append((i[0], o)))
    normed(_ids())
    assert len(seen) == 2 * a.n_layers
    for inp, out in seen:
        assert out.shape[-1] == a.hd and out.ndim == 4  # [B, T, heads, head_dim]: per head
        rms = out.pow(2).mean(-1).sqrt()
        torch.testing.assert_close(rms, torch.ones_like(rms), rtol=0, atol=1e-3)
        assert (inp.pow(2).mean(-1).sqrt() - 1).abs().max() > 0.1  # the projections' own scale is not 1


def test_relu2_mlp_is_two_matrices_with_the_swiglu_parameter_count():
    swiglu, relu2 = _model(), _model(mlp="relu2")
    a = relu2.args
    assert a.ffn_hidden == 3 * a.ffn_dim // 2 == 192
    ff = relu2.layers[0].feed_forward
    assert isinstance(ff, ReLU2MLP)
    assert {n for n, _ in ff.named_parameters()} == {"w3.weight", "w2.weight"}
    assert ff.w3.weight.shape == (192, 64) and ff.w2.weight.shape == (64, 192)
    assert relu2.num_params() == swiglu.num_params()
    x = torch.randn(2, 5, 64)
    torch.testing.assert_close(ff(x), torch.relu(x @ ff.w3.weight.T) ** 2 @ ff.w2.weight.T)
    # 125m: 3072 = 4 d_model, the parameters of the 2048-wide SwiGLU
    assert model_args("llama", "125m", {"mlp": "relu2"}).ffn_hidden == 3072
    loss = relu2.train()(_ids()).logsumexp(-1).mean()
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in relu2.parameters())
    with pytest.raises(ConfigError, match="mlp"):
        model_args("llama", "debug", {"mlp": "gelu"})


def test_zero_init_output_gives_uniform_logits_and_leaves_the_rest():
    base, zero = _model(), _model(zero_init_output=True)
    assert torch.count_nonzero(zero.output.weight) == 0
    logits = zero(_ids())
    assert torch.equal(logits, torch.zeros_like(logits))
    y = _ids(seed=5)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    assert math.isclose(loss.item(), math.log(512), rel_tol=1e-6)
    for k, v in base.state_dict().items():  # the same RNG draws: every other weight is unchanged
        if k != "output.weight":
            assert torch.equal(v, zero.state_dict()[k]), k
    # the head still learns on the first step (its gradient is softmax - one-hot times the hidden states)
    zero.train()
    F.cross_entropy(zero(_ids()).flatten(0, 1), y.flatten()).backward()
    assert zero.output.weight.grad.abs().sum() > 0
    with pytest.raises(ConfigError, match="untied"):
        model_args("llama", "debug", {"zero_init_output": True, "tie_embeddings": True})


def test_zero_init_proj_makes_every_block_the_identity():
    base, zero = _model(), _model(zero_init_proj=True)
    for layer in zero.layers:
        assert torch.count_nonzero(layer.attention.wo.weight) == 0
        assert torch.count_nonzero(layer.feed_forward.w2.weight) == 0
    ids = _ids()
    hidden = zero(ids, return_hidden=True)
    torch.testing.assert_close(hidden, zero.norm(zero.tok_embeddings(ids)), rtol=0, atol=1e-6)
    changed = {k for k, v in base.state_dict().items() if not torch.equal(v, zero.state_dict()[k])}
    assert changed == {
        f"layers.{i}.{m}.weight" for i in range(2) for m in ("attention.wo", "feed_forward.w2")
    }
    # with relu2 the down-projection is zeroed too
    relu2 = _model(zero_init_proj=True, mlp="relu2")
    assert torch.count_nonzero(relu2.layers[0].feed_forward.w2.weight) == 0


def test_logit_softcap_bounds_the_forward_logits():
    cap = 1.0
    plain, capped = _model(), _model(logit_softcap=cap)
    _perturb(plain)
    capped.load_state_dict(plain.state_dict())
    ids = _ids()
    raw, got = plain(ids), capped(ids)
    assert raw.abs().max() > 2 * cap  # the cap matters here
    assert got.abs().max() < cap
    torch.testing.assert_close(got, cap * torch.tanh(raw / cap))
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ConfigError, match="logit_softcap"):
            model_args("llama", "debug", {"logit_softcap": bad})
    with pytest.raises(ConfigError, match="llama family only"):
        model_args("llada", "debug", {"logit_softcap": 15.0})


@pytest.mark.parametrize("fused", [False, True])
def test_chunked_loss_with_softcap_equals_the_plain_loss(fused, monkeypatch):
    if fused:  # the compiled body's single-expression gradient, run eagerly
        monkeypatch.setattr(ce.torch.compiler, "is_compiling", lambda: True)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(100, 32, generator=g, dtype=torch.float64)
    w = torch.randn(300, 32, generator=g, dtype=torch.float64)
    t = torch.randint(0, 300, (100,), generator=g)
    t[::7] = -100
    cap = 4.0
    grads = []
    for fn in (
        lambda a, b: plain_linear_ce(a, b, t, softcap=cap),
        lambda a, b: chunked_linear_ce(a, b, t, chunk_size=32, softcap=cap),
        lambda a, b: make_loss("chunked", chunk_size=32)(a, b, t, softcap=cap),
    ):
        a, b = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(a, b)
        loss.backward()
        grads.append((loss.detach(), a.grad, b.grad))
    ref = grads[0]
    uncapped = plain_linear_ce(h, w, t)
    assert abs(ref[0] - uncapped) > 1.0  # the cap changes the loss
    for got in grads[1:]:
        for x, y in zip(got, ref):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("loss", ["plain", "chunked"])
def test_objective_applies_the_models_softcap(loss):
    model = _model(logit_softcap=3.0)
    _perturb(model)
    x, y = _ids(), _ids(seed=2)
    loss_sum, n = CausalLM(make_loss(loss, chunk_size=8))(model, (x, y))
    want = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(), reduction="sum")
    torch.testing.assert_close(loss_sum, want, rtol=1e-5, atol=1e-5)
    assert n.item() == y.numel()


def test_sampling_head_applies_the_softcap():
    from gptoughts.sampling import _head, generate

    model = _model(logit_softcap=3.0)
    _perturb(model)
    ids = _ids(b=1, t=6)
    torch.testing.assert_close(_head(model, model(ids, return_hidden=True)), model(ids), rtol=0, atol=1e-6)
    out = generate(model, ids, max_new_tokens=1, temperature=0.0)
    assert out[0, -1].item() == model(ids)[0, -1].argmax().item()


def test_model_switches_come_typed_from_the_command_line():
    cfg = load_config(
        "default",
        {
            "model.qk_norm": "true",
            "model.mlp": "relu2",
            "model.zero_init_output": "true",
            "model.zero_init_proj": "yes",
            "model.logit_softcap": "15",
        },
    )
    assert cfg.model.overrides == ON
    with pytest.raises(ConfigError, match="relu2"):
        load_config("default", {"model.mlp": "relu"})
    assert load_config("default", {"model.logit_softcap": "none"}).model.overrides["logit_softcap"] is None


def test_activation_estimate_counts_the_switches():
    a = model_args("llama", "125m", {})
    base = _layer_activation_bytes(a, "none", 4)
    assert _layer_activation_bytes(model_args("llama", "125m", {"mlp": "relu2"}), "none", 4) == base
    qk = _layer_activation_bytes(model_args("llama", "125m", {"qk_norm": True}), "none", 4)
    assert qk - base == 2 * (768 + 768)
    sel = _layer_activation_bytes(model_args("llama", "125m", {"mlp": "relu2"}), "selective", 4)
    # the block input, q and o, k and v, SDPA's output (r d + 4d + 4 d_kv + 2d), and relu2's one up-projection (2h)
    assert sel == (4 + 6) * 768 + 4 * 768 + 2 * 3072


# ------------------------------------------------------------------------------------------- HF export


def _export(model, tmp_path, name="out"):
    from gptoughts.data.tokenizer import bytes_tokenizer
    from gptoughts.models.hf_export import save_hf

    return save_hf(model, "llama", model.args, bytes_tokenizer(), tmp_path / name)


def test_relu2_exports_as_arcee_and_loads_back_natively(tmp_path):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "ArceeForCausalLM"):
        pytest.skip("this transformers has no Arcee")
    from gptoughts.models.hf import load_pretrained, read_config

    model = _model(mlp="relu2", zero_init_output=True, zero_init_proj=True)
    _perturb(model)
    out = _export(model, tmp_path)
    cfg = read_config(out)
    assert cfg["model_type"] == "arcee" and cfg["hidden_act"] == "relu2" and cfg["intermediate_size"] == 192
    ids = _ids()
    with torch.no_grad():
        ours = model(ids)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(out), dtype=torch.float32, attn_implementation="eager"
        ).eval()
        assert type(hf).__name__ == "ArceeForCausalLM"
        torch.testing.assert_close(hf(input_ids=ids).logits, ours, rtol=0, atol=1e-4)
        back = load_pretrained(out)
        assert back.family == "llama" and not back.generic and back.args.mlp == "relu2"
        assert back.args.ffn_dim == 128
        torch.testing.assert_close(back.model(ids), ours, rtol=0, atol=1e-5)


def test_qk_norm_exports_as_qwen3(tmp_path):
    pytest.importorskip("transformers")
    from gptoughts.models.hf import read_config

    assert read_config(_export(_model(qk_norm=True), tmp_path))["model_type"] == "qwen3"


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"logit_softcap": 15.0}, "model.logit_softcap"),
        ({"mlp": "relu2", "qk_norm": True}, "model.mlp = relu2 with model.qk_norm"),
        ({"qkv_bias": True, "qk_norm": True}, "model.qkv_bias with model.qk_norm"),
    ],
)
def test_export_refuses_a_switch_transformers_cannot_compute(overrides, named, tmp_path):
    with pytest.raises(UserError) as e:
        _export(_model(**overrides), tmp_path)
    msg = str(e.value)
    assert named in msg and "\n" not in msg
    assert not (tmp_path / "out").exists()  # refused before anything is written
    # over an earlier export, even with overwrite: the old files stay (validate everything, then write)
    from gptoughts.data.tokenizer import bytes_tokenizer
    from gptoughts.models.hf_export import save_hf

    old = _export(_model(), tmp_path, "old")
    before = {f.name: f.read_bytes() for f in old.iterdir() if f.is_file()}
    with pytest.raises(UserError):
        save_hf(
            _model(**overrides), "llama", _model(**overrides).args, bytes_tokenizer(), old, overwrite=True
        )
    assert {f.name: f.read_bytes() for f in old.iterdir() if f.is_file()} == before


# ----------------------------------------------------------------------------------------------- preset


PRESET = {k: v for k, v in ON.items() if k != "mlp"}  # relu2 did not pay in the ablation (BENCHMARKS)


def test_speedrun_preset_loads_with_its_switches():
    cfg = load_config("llama-125m-speedrun")
    assert (cfg.model.family, cfg.model.size) == ("llama", "125m")
    assert cfg.model.overrides == PRESET
    t = cfg.train
    assert (t.optimizer, t.schedule, t.block_size) == ("muon", "wsd", 1024)
    args = model_args("llama", "125m", cfg.model.overrides)
    with torch.device("meta"):
        n = build_model("llama", args, device="meta").num_params()
    # the parameters of plain 125m (135,285,504) plus the q/k norms' 2 x 64 per layer
    assert n == 135_285_504 + 2 * 64 * 12


def test_speedrun_preset_trains_two_steps_at_debug_size(tmp_path, text_corpus, cache_dir, fast):
    switches = load_config("llama-125m-speedrun").model.overrides
    o = dict(fast)
    o.update({f"model.{k}": v for k, v in switches.items()})  # --size drops a preset's shape fields: re-add
    o.update(
        {
            "data.sources": [str(text_corpus)],
            "run.out": str(tmp_path / "run"),
            "train.max_steps": 2,
            "train.eval_interval": 2,
        }
    )
    cfg = load_config("llama-125m-speedrun", o)
    assert cfg.model.size == "debug" and cfg.model.overrides == PRESET and cfg.train.optimizer == "muon"
    model, _, hist = api.run_training(cfg)
    assert hist.steps == 2 and hist.val_loss and all(math.isfinite(v) for v in hist.val_loss)
    inner = getattr(model, "module", model)
    assert inner.args.logit_softcap == 15.0 and inner.args.mlp == "swiglu" and inner.args.qk_norm
