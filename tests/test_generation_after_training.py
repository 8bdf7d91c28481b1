"""Generation after training: on sharded (FSDP2) and offloaded models of every family, and never at the cost of
a finished run.

FSDP2 with a bf16 mixed-precision policy keeps fp32 shards (in host memory under CPU offload) and computes in bf16
copies gathered for each forward: what generation allocates (the KV cache, the prompt, the sampling generator)
must follow the computation, not the stored shards. The runs here use a one-process gloo group, as
``--parallel.cpu_offload`` does on one GPU, and compare against the same model unwrapped, its parameters cast to
bf16 (the same arithmetic: greedy tokens and seeded samples are equal)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from gptoughts.data.tokenizer import bytes_tokenizer
from gptoughts.models import build_model, get_family, model_args
from gptoughts.parallel.dist import wrap_fsdp
from gptoughts.sampling import Sampler, compute_device, diffusion_generate, generate
from gptoughts.tools.tasks import generate_until, loglikelihoods

FAMILIES = ["llama", "gpt2", "deepseek", "inl", "llada"]


@pytest.fixture
def gloo_group():
    """A process group of one (gloo, an in-memory store), as ``parallel.dist.init`` starts for CPU offload."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _models(family: str, offload: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the model under FSDP2 with a bf16 compute policy, the same weights unwrapped with bf16 parameters)."""
    tok = bytes_tokenizer()
    torch.manual_seed(0)
    args = model_args(family, "debug", {"vocab_size": tok.vocab_size, "max_seq_len": 64})
    model = build_model(family, args, device="cpu")
    plain = copy.deepcopy(model)
    for p in plain.parameters():
        p.data = p.data.to(torch.bfloat16)
    return wrap_fsdp(model, "bf16", cpu_offload=offload), plain


@pytest.mark.parametrize("offload", [False, True], ids=["fsdp", "offload"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_under_fsdp_equals_the_plain_model(gloo_group, family, offload):
    """No autocast around the calls: the mixed-precision policy alone decides the compute dtype (the reported
    crash: a KV cache in the shards' fp32 met bf16 queries in SDPA)."""
    sharded, plain = _models(family, offload)
    prompt = torch.tensor([[5, 17, 42, 99, 7], [3, 3, 8, 120, 64]])
    if get_family(family).objective == "diffusion":
        kw = dict(gen_length=8, steps=8, block_length=4, temperature=0.0)
        got, want = diffusion_generate(sharded, prompt, **kw), diffusion_generate(plain, prompt, **kw)
    else:
        got = generate(sharded, prompt, 10, temperature=0.0)
        want = generate(plain, prompt, 10, temperature=0.0)
        assert torch.equal(generate(sharded, prompt, 10, temperature=0.0, use_cache=False), want)
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_sampler_and_task_scoring_on_an_offloaded_model(gloo_group, family):
    """What a run does with its model after training: the sampler's seeded sample, a generation task's greedy
    answers and a choice task's log-likelihoods, each equal to the plain bf16 model's."""
    sharded, plain = _models(family, offload=True)
    tok = bytes_tokenizer()
    diffusion = get_family(family).objective == "diffusion"
    texts = []
    for model in (sharded, plain):
        sampler = Sampler(model, tok, diffusion=diffusion, max_new_tokens=8, temperature=0.8)
        answers = generate_until(
            model, tok, ["def f(", "x = "], until=["\n"], max_new_tokens=6, diffusion=diffusion
        )
        lls = loglikelihoods(model, tok, [("a = ", "1"), ("b = ", "22")], diffusion=diffusion, mc_samples=2)
        texts.append((sampler("def "), answers, lls))
    assert texts[0] == texts[1]


def test_compute_device_is_the_mesh_device_of_offloaded_shards(monkeypatch):
    """Offloaded shards live in host memory while the forward runs on the GPU of the device mesh: the prompt,
    the KV cache and the sampling generator belong there (CPU tensors against GPU logits would fail)."""
    shard = SimpleNamespace(device=torch.device("cpu"), device_mesh=SimpleNamespace(device_type="cuda"))
    model = SimpleNamespace(parameters=lambda: iter([shard]))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert compute_device(model) == torch.device("cuda", 1)
    plain = torch.nn.Linear(2, 2)
    assert compute_device(plain) == torch.device("cpu")
