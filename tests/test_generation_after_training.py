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
from cli_helpers import FASTRUN, run_cli

from gptoughts.data.tokenizer import bytes_tokenizer
from gptoughts.models import build_model, get_family, model_args
from gptoughts.parallel.dist import wrap_fsdp
from gptoughts.sampling import Sampler, compute_device, diffusion_generate, generate
from gptoughts.tools.task_scorer import TaskScorer
from gptoughts.tools.tasks import generate_until, loglikelihoods
from gptoughts.training.checkpoint import store as ckpt

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


@pytest.mark.slow
def test_an_offloaded_bf16_run_samples_scores_and_ends_cleanly(tmp_path, text_corpus, cache_dir, capsys):
    """The reported command's shape on CPU: ``--parallel.cpu_offload true`` in bf16, with its end-of-run sample
    and task scoring, then ``gptoughts sample`` and ``gptoughts eval`` on the run."""
    run = tmp_path / "run"
    task = tmp_path / "gen.jsonl"
    task.write_text('{"prompt": "def ", "expected": "f", "until": ["(" ]}\n')
    argv = [
        "train",
        "--data",
        str(text_corpus),
        "--out",
        str(run),
        "--max_steps",
        "2",
        "--sample_interval",
        "2",
    ]
    argv += ["--parallel.cpu_offload", "true", "--precision", "bf16", "--eval_tasks", str(task), *FASTRUN]
    code, text = run_cli(argv, capsys)
    assert code == 0 and "Traceback" not in text and "warning: step" not in text, text[-2000:]
    assert "tasks gen exact_match" in text and "done (max steps)" in text
    assert (run / "samples.txt").read_text().count("--- prompt:") == 1
    code, text = run_cli(["sample", str(run), "--prompt", "def ", "--max_new_tokens", "4"], capsys)
    assert code == 0 and text.startswith("def "), text[-2000:]
    code, text = run_cli(["eval", str(run), "--tasks", str(task), "--device", "cpu"], capsys)
    assert code == 0 and "exact_match" in text, text[-2000:]


# ------------------------------------------------------------------------------- a failure after training


def _train_failing(tmp_path, corpus, capsys, monkeypatch, cls, *flags: str) -> tuple[int, str, list]:
    """A 2-step run whose ``cls.__call__`` (the sampler or the task scorer) raises; what the latest intact
    checkpoint was at each call."""
    run = tmp_path / "run"
    seen = []

    def fails(*args, **kwargs):
        last = ckpt.latest_valid(run / "checkpoints") if (run / "checkpoints").is_dir() else None
        seen.append(last.name if last else None)
        raise RuntimeError("out of memory while generating\nsecond line of the error")

    monkeypatch.setattr(cls, "__call__", fails)
    argv = ["train", "--data", str(corpus), "--out", str(run), "--max_steps", "2", *flags, *FASTRUN]
    code, text = run_cli(argv, capsys)
    assert ckpt.latest_valid(run / "checkpoints").name == "step_000002"
    return code, text, seen


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [["--sample_interval", "2"], ["--sample_interval", "0"]],
    ids=["trainer-sample-at-the-last-step", "summary-sample-only"],
)
def test_a_failing_sample_after_training_is_one_warning_after_the_final_checkpoint(
    tmp_path, text_corpus, cache_dir, capsys, monkeypatch, flags
):
    code, text, seen = _train_failing(tmp_path, text_corpus, capsys, monkeypatch, Sampler, *flags)
    assert code == 0 and "Traceback" not in text, text[-2000:]
    assert seen == ["step_000002"]  # called once, with the final checkpoint already on disk
    warnings = [ln for ln in text.splitlines() if "out of memory while generating" in ln]
    assert len(warnings) == 1 and warnings[0].startswith("warning:"), text[-2000:]
    assert "second line" not in text
    assert "done (max steps)" in text  # the summary still ends the run


def test_a_failing_periodic_sample_is_one_warning_and_training_goes_on(
    tmp_path, text_corpus, cache_dir, capsys, monkeypatch
):
    code, text, seen = _train_failing(
        tmp_path, text_corpus, capsys, monkeypatch, Sampler, "--sample_interval", "1"
    )
    assert code == 0 and "Traceback" not in text, text[-2000:]
    assert len(seen) == 1  # dropped after the first failure (step 1), not retried at the end
    assert "warning: step 1: sampling failed (out of memory while generating)" in text
    assert "done (max steps)" in text


@pytest.mark.slow
def test_failing_task_scoring_at_the_end_comes_after_the_final_checkpoint(
    tmp_path, text_corpus, cache_dir, capsys, monkeypatch
):
    task = tmp_path / "mc.jsonl"
    task.write_text('{"context": "x =", "choices": [" 1", "!!"], "answer": 0}\n')
    flags = ["--eval_tasks", str(task), "--eval_tasks_interval", "0", "--sample_interval", "0"]
    code, text, seen = _train_failing(tmp_path, text_corpus, capsys, monkeypatch, TaskScorer, *flags)
    assert code == 0 and "Traceback" not in text, text[-2000:]
    assert seen == ["step_000002"]
    assert sum("out of memory while generating" in ln for ln in text.splitlines()) == 1
    assert "done (max steps)" in text
