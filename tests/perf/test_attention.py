"""Attention routing (FA4, FlexAttention for packed rows) on CPU: numerics against the SDPA paths, the rules
that send a call to SDPA, the errors of a kernel this machine lacks, and the config fields."""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

from gptoughts.config import PerfConfig, load_config
from gptoughts.errors import ConfigError, UserError
from gptoughts.models import build_model, model_args
from gptoughts.models.layers import AttentionKernels, sdpa, use_attention_kernels
from gptoughts.perf import attention
from gptoughts.training.resolve import attention_rule, check_attention
from gptoughts.training.setup import attention_kernels

warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


def _qkv(b=2, h=4, kv=2, t=40, hd=16, grad=False):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, t, hd, generator=g) for n in (h, kv, kv))
    return [x.requires_grad_(grad) for x in (q, k, v)]


def _docs(b: int, t: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.cumsum(torch.rand(b, t, generator=g) < 0.08, dim=1)  # ~t/12 documents per row


# ------------------------------------------------------------------------------------ flex: packed rows


@pytest.mark.parametrize(
    ("h", "kv", "causal", "window"),
    [(4, 4, True, None), (4, 2, True, None), (4, 1, True, 7), (4, 2, False, None), (4, 2, False, 9)],
)
def test_flex_doc_mask_matches_dense_mask_sdpa(monkeypatch, h, kv, causal, window):
    """Forward and q/k/v gradients of the FlexAttention route equal the dense-mask SDPA route (GQA, windows,
    bidirectional). torch refuses flex backward on CPU by a device check alone (its eager implementation is a
    differentiable reference); the test lifts that check to compare gradients here."""
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)
    t = 150  # two 128-blocks, the second partial: block skipping and padding both happen
    q, k, v = _qkv(h=h, kv=kv, t=t, grad=True)
    doc = _docs(2, t)
    ref = sdpa(q, k, v, causal=causal, window=window, doc_ids=doc)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    with use_attention_kernels(AttentionKernels(doc=attention.FlexDocAttention(compiled=False))):
        got = sdpa(q, k, v, causal=causal, window=window, doc_ids=doc)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-4)


def test_flex_block_mask_built_once_per_batch(monkeypatch):
    built = []
    real = attention.doc_block_mask
    monkeypatch.setattr(attention, "doc_block_mask", lambda *a, **kw: built.append(1) or real(*a, **kw))
    flex = attention.FlexDocAttention(compiled=False)
    q, k, v = _qkv()
    doc = _docs(2, 40)
    with torch.no_grad(), use_attention_kernels(AttentionKernels(doc=flex)):
        for _ in range(3):  # three layers of one forward
            sdpa(q, k, v, doc_ids=doc)
        assert len(built) == 1
        sdpa(q, k, v, doc_ids=doc, window=5)  # another layer kind: its own mask
        sdpa(q, k, v, doc_ids=doc.clone())  # the next batch
        doc.add_(1)  # changed in place: not the same batch any more
        sdpa(q, k, v, doc_ids=doc)
    assert len(built) == 4


def test_model_with_flex_docs_matches_sdpa_forward():
    torch.manual_seed(0)
    model = build_model("llama", model_args("llama", "debug", {}), device="cpu").eval()
    ids = torch.randint(0, 512, (2, 24))
    doc = _docs(2, 24)
    with torch.no_grad():
        ref = model(ids, doc_ids=doc)
        with use_attention_kernels(AttentionKernels(doc=attention.FlexDocAttention(compiled=False))):
            got = model(ids, doc_ids=doc)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)


# ------------------------------------------------------------------------------------ FA4 routing rules


class StubFA4:
    """Records the calls ``sdpa`` routes to FA4 and answers with SDPA in FA4's [B, T, H, hd] layout."""

    def __init__(self, accepts: bool = True) -> None:
        self.calls: list[dict] = []
        self._accepts = accepts

    def accepts(self, q, k, v) -> bool:
        return self._accepts

    def __call__(self, q, k, v, *, causal, window):
        self.calls.append({"shape": tuple(q.shape), "causal": causal, "window": window})
        assert q.shape[1] == k.shape[1] and q.shape[2] >= k.shape[2]  # [B, T, H, hd], GQA heads unexpanded
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True).transpose(1, 2)


def test_fa4_takes_mask_free_calls_only():
    stub = StubFA4()
    q, k, v = _qkv()
    with use_attention_kernels(AttentionKernels(fa4=stub)):
        torch.testing.assert_close(
            sdpa(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        )
        sdpa(q, k, v, causal=False)
        sdpa(q, k, v, window=7)  # sliding window: FA4 has it natively
        sdpa(q, k, v, window=40)  # a window covering the keys is no window
        assert [(c["causal"], c["window"]) for c in stub.calls] == [
            (True, None),
            (False, None),
            (True, 7),
            (True, None),
        ]
        assert stub.calls[0]["shape"] == (2, 40, 4, 16)
        n = len(stub.calls)
        sdpa(q, k, v, doc_ids=_docs(2, 40))  # a document mask (no doc kernel set): dense-mask SDPA
        sdpa(q[:, :, -5:], k, v)  # prefill after a cached prefix (Tq != Tk)
        sdpa(q[:, :, -1:], k, v)  # decoding one token
        assert len(stub.calls) == n
    with use_attention_kernels(AttentionKernels(fa4=StubFA4(accepts=False))) as _:
        sdpa(q, k, v)  # the kernel declines (device, dtype, head size): SDPA
    sdpa(q, k, v)  # outside the context: SDPA
    assert len(stub.calls) == n


def test_model_through_fa4_layout_matches_sdpa():
    """A whole model with every attention through the (stub) FA4 route gives SDPA's logits: the [B, T, H, hd]
    layout handed to FA4 and the transposes back are right."""
    torch.manual_seed(0)
    model = build_model("llama", model_args("llama", "debug", {}), device="cpu").eval()
    ids = torch.randint(0, 512, (2, 16))
    stub = StubFA4()
    with torch.no_grad():
        ref = model(ids)
        with use_attention_kernels(AttentionKernels(fa4=stub)):
            got = model(ids)
    assert len(stub.calls) == len(model.layers)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_fa4_accepts_only_half_precision_cuda_tensors():
    q, k, v = _qkv()
    assert not attention.FA4().accepts(q, k, v)  # CPU fp32
    assert not attention.FA4().accepts(q.bfloat16(), k.bfloat16(), v.bfloat16())  # CPU


def _fake_flash_attn(monkeypatch) -> list[dict]:
    """A stand-in for flash_attn.cute.interface computing FA4's outputs with torch on CPU, so the custom op,
    its fake implementation and its registered backward are exercised without a GPU."""
    calls: list[dict] = []

    def scores(q, k, causal, left, right):
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, hd]
        k = k.repeat_interleave(q.size(1) // k.size(1), 1)
        s = q @ k.transpose(-1, -2) / q.size(-1) ** 0.5
        i = torch.arange(q.size(2))
        d = i[:, None] - i[None, :]
        ok = torch.ones_like(d, dtype=torch.bool)
        if causal:
            ok &= d >= 0
        if left is not None:
            ok &= d <= left
        if right is not None:
            ok &= -d <= right
        return s.masked_fill(~ok, float("-inf"))

    def attend(q, k, v, causal, left, right):
        s = scores(q, k, causal, left, right)
        vv = v.transpose(1, 2).repeat_interleave(q.size(2) // v.size(2), 1)
        return (s.softmax(-1) @ vv).transpose(1, 2), s.logsumexp(-1)

    def fwd(q, k, v, *, causal, window_size_left, window_size_right, return_lse):
        calls.append({"causal": causal, "left": window_size_left, "right": window_size_right})
        out, lse = attend(q, k, v, causal, window_size_left, window_size_right)
        return out, lse, None, None, None

    def bwd(q, k, v, out, dout, lse, *, causal, window_size_left, window_size_right, deterministic):
        # the analytic gradient (a custom op's body runs below autograd: no torch.autograd.grad here)
        n_rep = q.size(2) // k.size(2)
        p = scores(q, k, causal, window_size_left, window_size_right).softmax(-1)  # [B, H, T, T]
        q_, o, do = (x.transpose(1, 2) for x in (q, out, dout))
        k_, v_ = (x.transpose(1, 2).repeat_interleave(n_rep, 1) for x in (k, v))
        ds = p * (do @ v_.transpose(-1, -2) - (do * o).sum(-1, keepdim=True)) / q.size(-1) ** 0.5
        dq, dk, dv = ds @ k_, ds.transpose(-1, -2) @ q_, p.transpose(-1, -2) @ do
        b, h, t, hd = dk.shape
        dk, dv = (x.view(b, h // n_rep, n_rep, t, hd).sum(2) for x in (dk, dv))
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    iface = types.ModuleType("flash_attn.cute.interface")
    iface._flash_attn_fwd, iface._flash_attn_bwd = fwd, bwd
    for name in ("flash_attn", "flash_attn.cute"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", iface)
    return calls


@pytest.mark.parametrize(
    ("causal", "window", "left", "right"), [(True, None, None, None), (True, 5, 4, None), (False, 6, 5, 5)]
)
def test_fa4_custom_op_compiles_and_differentiates(monkeypatch, causal, window, left, right):
    """The FA4 custom op under torch.compile (fullgraph: one opaque node, the fake implementation gives the
    shapes) matches SDPA in forward and q/k/v gradients, with GQA and sliding windows."""
    calls = _fake_flash_attn(monkeypatch)
    q, k, v = _qkv(grad=True)
    from gptoughts.models.layers import attention_mask

    mask = attention_mask(40, 40, causal=causal, window=window)
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask
    )
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    kernels = AttentionKernels(fa4=attention.FA4())
    monkeypatch.setattr(attention.FA4, "accepts", lambda self, q, k, v: True)  # CPU fp32 in this test
    fn = torch.compile(
        lambda q, k, v: sdpa(q, k, v, causal=causal, window=window), backend="aot_eager", fullgraph=True
    )
    with use_attention_kernels(kernels):
        got = fn(q, k, v)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    assert calls and calls[-1] == {"causal": causal, "left": left, "right": right}
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-4)


@pytest.mark.parametrize(("mode", "forwards"), [("selective", 1), ("full", 2)])
def test_selective_checkpointing_keeps_fa4_output(monkeypatch, mode, forwards):
    """Selective activation checkpointing saves FA4's output like SDPA's: its forward is not run again in the
    backward (full checkpointing does run it again)."""
    from gptoughts.perf.checkpointing import apply_activation_checkpointing

    calls = _fake_flash_attn(monkeypatch)
    monkeypatch.setattr(attention.FA4, "accepts", lambda self, q, k, v: True)
    model = build_model("llama", model_args("llama", "debug", {}), device="cpu")
    apply_activation_checkpointing(model, mode)
    with use_attention_kernels(AttentionKernels(fa4=attention.FA4())):
        model(torch.randint(0, 512, (2, 16))).sum().backward()
    assert len(calls) == forwards * len(model.layers)


# ------------------------------------------------------------------------------------ errors and config


def test_fa4_without_the_package_is_one_line_naming_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # `import flash_attn.cute` raises ImportError
    with pytest.raises(UserError) as e:
        check_attention(PerfConfig(sdpa_backend="fa4"), torch.device("cuda"))
    msg = str(e.value)
    assert "\n" not in msg and "pip install flash-attn-4" in msg and "--perf.sdpa_backend auto" in msg
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(UserError, match="sm90"):
        check_attention(PerfConfig(sdpa_backend="fa4"), torch.device("cuda"))


def test_fa4_on_cpu_refused_before_the_run_dir_is_written(tmp_path):
    from gptoughts.training.build import build

    out = tmp_path / "run"
    cfg = load_config("quickstart", {"run.out": str(out), "perf.sdpa_backend": "fa4", "perf.device": "cpu"})
    with pytest.raises(UserError, match="fa4: FlashAttention-4 needs an NVIDIA"):
        build(cfg)
    assert not out.exists()


def test_doc_mask_attention_rules_on_cpu():
    cpu = torch.device("cpu")
    chosen, why = attention_rule(PerfConfig(), cpu)
    assert attention_kernels(chosen, cpu) == AttentionKernels() and chosen == {
        "sdpa_backend": "auto",
        "doc_mask_attention": "sdpa",
    }
    assert why["doc_mask_attention"].startswith("auto: dense mask")
    chosen, why = attention_rule(PerfConfig(doc_mask_attention="sdpa"), cpu)
    assert (chosen["doc_mask_attention"], why["doc_mask_attention"]) == ("sdpa", "asked")
    with pytest.raises(UserError, match="doc_mask_attention = flex: .*use auto or sdpa"):
        attention_rule(PerfConfig(doc_mask_attention="flex"), cpu)


def test_attention_config_fields():
    cfg = load_config("quickstart", {"perf.sdpa_backend": "fa4", "perf.doc_mask_attention": "flex"})
    assert (cfg.perf.sdpa_backend, cfg.perf.doc_mask_attention) == ("fa4", "flex")
    assert load_config("quickstart").perf.doc_mask_attention == "auto"
    with pytest.raises(ConfigError, match="fa4"):
        load_config("quickstart", {"perf.sdpa_backend": "fa5"})
    with pytest.raises(ConfigError, match="doc_mask_attention"):
        load_config("quickstart", {"perf.doc_mask_attention": "dense"})


def test_env_lists_attention_backends():
    rows = attention.available(torch.device("cpu"))
    assert set(rows) == {"sdpa", "fa4", "flex"}
    assert rows["fa4"].startswith("unavailable: ") and rows["flex"].startswith("unavailable: ")


def test_env_command_shows_attention_backends(capsys):
    import json

    from gptoughts.cli import main

    assert main(["env", "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["attention"]) == {"sdpa", "fa4", "flex"}
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "attention  sdpa: available" in out and "fa4: unavailable" in out
