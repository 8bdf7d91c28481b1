from __future__ import annotations

import math

import pytest
import torch

from gptoughts.errors import UserError
from gptoughts.models import build_model, model_args
from gptoughts.sampling import filter_top_k_top_p, generate, sample_top_k_top_p


def _model(**overrides):
    torch.manual_seed(0)
    return build_model("llama", model_args("llama", "debug", overrides), device="cpu")


def _prompt(b: int = 3, t: int = 5) -> torch.Tensor:
    return torch.randint(0, 512, (b, t), generator=torch.Generator().manual_seed(1))


def test_greedy_cache_matches_recompute():
    model = _model()
    prompt = _prompt()
    with_cache = generate(model, prompt, 24, temperature=0.0)
    without = generate(model, prompt, 24, temperature=0.0, use_cache=False)
    assert with_cache.shape == (3, 29)
    assert torch.equal(with_cache[:, :5], prompt)
    assert torch.equal(with_cache, without)


def test_greedy_matches_manual_argmax_loop():
    model = _model().eval()
    seq = _prompt()
    out = generate(model, seq, 4, temperature=0.0)
    with torch.no_grad():
        for _ in range(4):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


def test_sampling_is_deterministic_and_path_independent():
    model = _model()
    prompt = _prompt()
    kw = dict(temperature=0.9, top_k=50, top_p=0.95)
    a = generate(model, prompt, 16, generator=torch.Generator().manual_seed(42), **kw)
    b = generate(model, prompt, 16, generator=torch.Generator().manual_seed(42), use_cache=False, **kw)
    c = generate(model, prompt, 16, generator=torch.Generator().manual_seed(43), **kw)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_top_k_1_is_greedy():
    model = _model()
    prompt = _prompt()
    greedy = generate(model, prompt, 12, temperature=0.0)
    top1 = generate(model, prompt, 12, temperature=1.5, top_k=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(greedy, top1)


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.05, 0.5, 0.125, 0.25, 0.075])  # sorted: 0.5, 0.25, 0.125, 0.075, 0.05
    logits = probs.log()

    def kept(p: float) -> set[int]:
        out = filter_top_k_top_p(logits, top_p=p)
        return set(torch.nonzero(torch.isfinite(out)).flatten().tolist())

    assert kept(0.3) == {1}
    assert kept(0.7) == {1, 3}  # 0.5 < 0.7 <= 0.75
    assert kept(0.8) == {1, 3, 2}  # 0.75 < 0.8 <= 0.875
    assert kept(0.9) == {1, 3, 2, 4}
    assert kept(1.0) == {0, 1, 2, 3, 4}
    # batched rows are independent, kept logits are untouched
    both = filter_top_k_top_p(torch.stack([logits, logits.flip(0)]), top_p=0.7)
    assert torch.equal(torch.isfinite(both[1]), torch.isfinite(both[0]).flip(0))
    assert torch.equal(both[0, 1], logits[1])


def test_top_k_filter_and_sampler():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    out = filter_top_k_top_p(logits, top_k=2)
    assert torch.isfinite(out).tolist() == [[False, True, False, True]]
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_top_k_top_p(logits, top_k=2, generator=g) for _ in range(400)])
    assert set(draws.flatten().tolist()) == {1, 3}
    # P(1) / P(3) = e under the filtered softmax
    frac = (draws == 1).float().mean().item()
    assert abs(frac - math.e / (1 + math.e)) < 0.08
    assert sample_top_k_top_p(logits, temperature=0.0).tolist() == [1]


def test_stops_when_every_row_emitted_eos():
    model = _model()
    with torch.no_grad():
        model.norm.weight.zero_()  # hidden state 0 -> all logits equal -> argmax picks token 0
    out = generate(model, _prompt(), 10, temperature=0.0, eos_id=0)
    assert out.shape == (3, 6) and out[:, -1].eq(0).all()


def test_finished_rows_are_padded_with_eos():
    model = _model()
    prompt = _prompt()
    free = generate(model, prompt, 12, temperature=0.0)
    eos = int(free[0, 7])  # row 0 emits this token at its 3rd step
    out = generate(model, prompt, 12, temperature=0.0, eos_id=eos)
    for row in range(3):
        gen = out[row, 5:].tolist()
        if eos in gen:
            first = gen.index(eos)
            assert all(t == eos for t in gen[first:])
            assert gen[:first] == free[row, 5 : 5 + first].tolist()
        else:
            assert gen == free[row, 5:].tolist()


def test_an_end_id_finishes_a_row_as_eos_does():
    # a chat template's end of turn (<|im_end|>): the row stops there, and is padded with eos after it
    model = _model()
    prompt = _prompt()
    free = generate(model, prompt, 12, temperature=0.0)
    end = int(free[0, 7])  # row 0 emits this token at its 3rd step
    eos = next(t for t in range(model.args.vocab_size) if t not in free.tolist()[0])
    out = generate(model, prompt, 12, temperature=0.0, eos_id=eos, end_ids=[end])
    gen = out[0, 5:].tolist()
    assert gen[: gen.index(end) + 1] == free[0, 5:8].tolist() and set(gen[3:]) <= {eos}


def test_length_limits():
    model = _model(max_seq_len=16)
    prompt = _prompt(t=10)
    assert generate(model, prompt, 7, temperature=0.0).shape == (3, 17)  # 16 positions are fed
    with pytest.raises(UserError, match="max_seq_len=16"):
        generate(model, prompt, 8, temperature=0.0)
    # without cache the window slides over the last max_seq_len tokens
    slid = generate(model, prompt, 20, temperature=0.0, use_cache=False)
    assert slid.shape == (3, 30)
    assert torch.equal(slid[:, :17], generate(model, prompt, 7, temperature=0.0))


def test_restores_training_mode_and_needs_no_grad():
    model = _model().train()
    out = generate(model, _prompt(), 3)
    assert model.training and not out.requires_grad
    assert generate(model, _prompt(), 0).shape == (3, 5)


@pytest.mark.parametrize("temperature", [1e-40, 1e-37, 5e-324])
def test_a_tiny_temperature_samples_the_argmax(temperature):
    # logits / 1e-40 overflowed to inf, the softmax to NaN, and every row sampled token 0
    logits = torch.randn(4, 512, generator=torch.Generator().manual_seed(0)) * 20
    for kw in ({}, dict(top_k=50, top_p=0.9)):
        got = sample_top_k_top_p(
            logits, temperature=temperature, generator=torch.Generator().manual_seed(1), **kw
        )
        assert torch.equal(got, logits.argmax(-1))


def test_a_tiny_temperature_decodes_greedily_on_the_transformers_path():
    """A generic transformers model decodes through transformers' generate, which raised on inf probabilities."""
    import transformers

    from gptoughts.models.hf_generic import HFCausalLM

    cfg = transformers.GPTNeoXConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=96,
        max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = HFCausalLM(transformers.GPTNeoXForCausalLM(cfg))
    with torch.no_grad():
        model.hf.get_output_embeddings().weight.mul_(1e3)  # logits in the hundreds
    prompt = torch.tensor([[5, 17, 42]])
    greedy = generate(model, prompt, 6, temperature=0.0)
    tiny = generate(model, prompt, 6, temperature=1e-40, generator=torch.Generator().manual_seed(0))
    assert torch.equal(tiny, greedy)
    # an end of turn stops transformers' generate too (it ran on to max_new_tokens past the answer)
    end = int(greedy[0, 3])  # the first token it generates
    eos = next(t for t in range(96) if t not in greedy.tolist()[0])
    ended = generate(model, prompt, 6, temperature=0.0, eos_id=eos, end_ids=[end])
    assert ended[0].tolist() == greedy[0, :4].tolist()


@pytest.mark.parametrize("diffusion", [False, True], ids=["causal", "diffusion"])
def test_check_room_refuses_exactly_the_lengths_sampling_refuses(diffusion):
    # a training run checks its samples' length before it trains: what it lets through must generate, and what it
    # refuses must be what generation would refuse at the run's end (was: a warning after the last step)
    from gptoughts.data.tokenizer import bytes_tokenizer
    from gptoughts.sampling import Sampler

    torch.manual_seed(0)
    family = "llada" if diffusion else "llama"
    overrides = {"vocab_size": 320, "max_seq_len": 12} | ({"mask_token_id": 2} if diffusion else {})
    model = build_model(family, model_args(family, "debug", overrides), device="cpu")
    tok = bytes_tokenizer()
    for prompt in ("", "abcd"):
        allowed = []
        for n in range(1, 15):
            sampler = Sampler(model, tok, diffusion=diffusion, max_new_tokens=n, temperature=0.0)
            try:
                sampler.check_room([prompt], ("--sample_max_new_tokens", "--sample_prompts"))
                checked = True
            except UserError as e:
                checked, message = False, str(e)
            try:
                sampler(prompt)
                generated = True
            except UserError:
                generated = False
            assert checked == generated, (prompt, n)
            if checked:
                allowed.append(n)
        most = max(allowed)
        assert allowed == list(range(1, most + 1))
        assert f"--sample_max_new_tokens 14: the prompt {prompt!r}" in message
        assert message.endswith(f"pass --sample_max_new_tokens {most} or less") and "\n" not in message
    sampler = Sampler(model, tok, diffusion=diffusion, max_new_tokens=1)
    with pytest.raises(UserError, match=r"shorten the prompt \(--sample_prompts\)"):
        sampler.check_room(["x" * 20], ("--sample_max_new_tokens", "--sample_prompts"))
