"""Autoregressive sampling for causal models (any model obeying the protocol of ``docs/internals.md``).

``generate`` decodes with the model's KV cache by default; ``use_cache=False`` recomputes the whole
sequence at every step and is kept as the reference path (tests check both agree token for token).

Length limit: a model never sees more than ``model.args.max_seq_len`` positions. Without a cache, the
input is a sliding window over the last ``max_seq_len`` tokens, so any ``max_new_tokens`` works. With a
cache, positions cannot slide (cached keys carry their RoPE phase), so a request that would need more than
``max_seq_len`` positions raises a ``UserError`` up front rather than failing midway.

Sampling draws through an explicit ``torch.Generator`` when one is given (on the logits' device), so a
seeded generator reproduces the same tokens whichever path computed the logits.

``diffusion_generate`` samples from masked-diffusion models (LLaDA): no cache, a fixed number of denoising
steps over a fixed-length answer.

:class:`Sampler` is the one place that turns a prompt into text for any model: causal or diffusion is
decided once, from the family's objective; the chat template is applied for SFT runs and chat models. The API
(``gptoughts.generate``), ``gptoughts sample``, the trainer's periodic samples and evaluation all use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from gptoughts.errors import UserError
from gptoughts.models.layers import softcap

__all__ = [
    "Sampler",
    "compute_device",
    "diffusion_generate",
    "eager",
    "filter_top_k_top_p",
    "generate",
    "sample_top_k_top_p",
]

# Decoding changes the key length at every step. On H100/H200 (torch 2.11) SDPA prefers cuDNN, which builds
# an execution plan per new shape: ~10x slower decoding than flash (measured: docs/performance.md).
# Generation therefore runs with cuDNN excluded; training (static shapes) is unaffected.
_DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def compute_device(model: nn.Module) -> torch.device:
    """The device ``model``'s forward runs on, where prompts, caches and sampling generators belong.

    That is where its parameters are, except under FSDP2's CPU offload: the shards (DTensors) stay in host memory
    between forwards while each forward runs on the device of their mesh (FSDP moves the inputs there), the
    current one of its kind, as FSDP picks it."""
    param = next(model.parameters())
    mesh = getattr(param, "device_mesh", None)
    if mesh is None or mesh.device_type == param.device.type:
        return param.device
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def filter_top_k_top_p(
    logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """``logits [..., V]`` with every token outside the top-k / nucleus set to ``-inf``.

    Top-p keeps the smallest set of most probable tokens whose cumulative probability is >= ``top_p``
    (always at least one token). When both are given, top-k is applied first.
    """
    if top_k is not None and top_k > 0 and top_k < logits.size(-1):
        # topk + a threshold compare instead of a full sort: O(V) rather than O(V log V).
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # A token is dropped when the tokens ranked before it already reach top_p; the first is always kept.
        before = probs.cumsum(dim=-1) - probs
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, sorted_idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_top_k_top_p(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token id per row of ``logits [..., V]`` (returns ``[...]`` int64). ``temperature == 0``: argmax."""
    if temperature < 0:
        raise UserError(f"temperature must be >= 0, got {temperature}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise UserError(f"top_p must be in (0, 1], got {top_p}")
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    # logits / t overflows for a tiny t (inf - inf: NaN). With the max subtracted first the best token scales to 0
    # and the others towards -inf, so sampling tends to argmax as t -> 0; the floor keeps t from rounding to 0 in
    # fp32 (0 / 0).
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / max(temperature, torch.finfo(logits.dtype).tiny)
    logits = filter_top_k_top_p(scaled, top_k, top_p)
    probs = logits.softmax(dim=-1)
    # argmax(p / E) with E ~ Exp(1) samples from p (the exponential race) without the device->host sync of
    # torch.multinomial. The clamp avoids 0/0 = NaN if the exponential draw were exactly 0.
    race = (
        torch.empty_like(probs)
        .exponential_(1.0, generator=generator)
        .clamp_min_(torch.finfo(probs.dtype).tiny)
    )
    return (probs / race).argmax(dim=-1)


@torch.no_grad()  # not inference_mode: torchao float8 tensor subclasses reject inference tensors
def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    stop: Callable[[torch.Tensor], list[bool]] | None = None,
    end_ids: Sequence[int] = (),
) -> torch.Tensor:
    """Extend the prompts ``input_ids [B, T]`` (same length, no padding) by up to ``max_new_tokens``.

    Returns ``[B, T + n]`` with ``n <= max_new_tokens``: generation stops early once every row has
    produced ``eos_id`` (or one of ``end_ids``, with ``eos_id``: a chat template's end of turn); rows that finished
    earlier are padded with ``eos_id``. ``temperature=0`` is greedy.
    ``stop`` (with ``eos_id``): called every :data:`STOP_EVERY` tokens with the tokens generated so far
    (``[B, n]``, on the host); the rows it marks True are finished as at eos (an evaluation's stop strings: a row
    whose text already holds one need not run on to ``max_new_tokens``). Not for generic transformers models.
    The model is put in eval mode for the call and restored afterwards.
    """
    if input_ids.ndim != 2 or input_ids.size(1) == 0:
        raise UserError(
            f"input_ids must be a non-empty [batch, seq] tensor, got shape {tuple(input_ids.shape)}"
        )
    if max_new_tokens <= 0:
        return input_ids
    hf_generate = getattr(model, "hf_generate", None)
    if (
        hf_generate is not None
    ):  # generic transformers models (models/hf_generic.py) decode with their own KV cache
        return hf_generate(
            input_ids,
            max_new_tokens,
            # transformers divides the logits by the temperature: below this they overflow fp32 to inf and its
            # multinomial raises, where greedy decoding is the limit asked for
            temperature=temperature if temperature >= _HF_MIN_TEMPERATURE else 0.0,
            top_k=top_k,
            top_p=top_p,
            eos_id=eos_id,
            end_ids=end_ids,
            generator=generator,
        )
    max_seq_len = model.args.max_seq_len
    bsz, prompt_len = input_ids.shape
    if use_cache and _positions(prompt_len, max_new_tokens) > max_seq_len:
        raise UserError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) needs "
            f"{_positions(prompt_len, max_new_tokens)} positions but the model has max_seq_len={max_seq_len}; "
            "shorten the prompt or max_new_tokens (gptoughts.sampling.generate(model, ids, n, use_cache=False) "
            "slides a window over the last max_seq_len tokens instead)"
        )

    was_training = model.training
    model.eval()
    try:
        with sdpa_kernel(_DECODE_BACKENDS):
            return _decode(
                model,
                input_ids,
                max_new_tokens,
                use_cache,
                eos_id,
                dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator),
                stop,
                end_ids,
            )
    finally:
        model.train(was_training)


def _decode(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    use_cache: bool,
    eos_id: int | None,
    sampling: dict,
    stop: Callable[[torch.Tensor], list[bool]] | None = None,
    end_ids: Sequence[int] = (),
) -> torch.Tensor:
    max_seq_len = model.args.max_seq_len
    bsz, prompt_len = input_ids.shape
    ends = torch.tensor([eos_id, *end_ids], device=input_ids.device) if eos_id is not None else None
    out = torch.empty(bsz, prompt_len + max_new_tokens, dtype=input_ids.dtype, device=input_ids.device)
    out[:, :prompt_len] = input_ids
    done = torch.zeros(bsz, dtype=torch.bool, device=input_ids.device)
    cache = model.new_cache(bsz, prompt_len + max_new_tokens - 1) if use_cache else None
    cur = prompt_len
    step_input = input_ids
    for _ in range(max_new_tokens):
        if not use_cache:
            step_input = out[:, max(0, cur - max_seq_len) : cur]
        hidden = model(step_input, cache=cache, return_hidden=True)
        # Only the last position needs logits: skips a [B, T, V] matmul over the prompt at prefill.
        logits = _head(model, hidden[:, -1])
        token = sample_top_k_top_p(logits, **sampling)
        if eos_id is not None:
            token = token.masked_fill(done, eos_id)
            done |= torch.isin(token, ends)
        out[:, cur] = token
        cur += 1
        step_input = token[:, None]
        # One host sync per token to stop early; generation is latency-bound anyway, and this is the only
        # sync in the loop (sampling avoids torch.multinomial's).
        if eos_id is not None and stop is not None and (cur - prompt_len) % STOP_EVERY == 0:
            # Decoding every row's text each token would cost more than the forward of a small model.
            done |= torch.tensor(stop(out[:, prompt_len:cur].cpu()), dtype=torch.bool, device=done.device)
        if eos_id is not None and bool(done.all()):
            break
    return out[:, :cur]


def _positions(prompt_len: int, new_tokens: int, diffusion: bool = False) -> int:
    """The positions a sample of ``new_tokens`` after ``prompt_len`` tokens takes: the cached causal sampler never
    feeds its last token back, the diffusion sampler holds every answer position."""
    return prompt_len + new_tokens - (0 if diffusion else 1)


_HF_MIN_TEMPERATURE = 1e-30
STOP_EVERY = 8
"""Tokens between two calls of ``generate``'s ``stop`` (its check decodes every row on the host)."""


# ------------------------------------------------------------------------------- masked diffusion (LLaDA)

_REMASKING = ("low_confidence", "random")


@torch.no_grad()  # not inference_mode: torchao float8 tensor subclasses reject inference tensors
def diffusion_generate(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    *,
    gen_length: int,
    steps: int,
    block_length: int,
    temperature: float = 0.0,
    cfg_scale: float = 0.0,
    remasking: str = "low_confidence",
    mask_id: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """LLaDA's reverse process: ``prompt_ids [B, P]`` followed by ``gen_length`` mask tokens, denoised in
    ``steps`` model calls. Returns ``[B, P + gen_length]`` (prompt included) with no mask token left.

    Semantics of LLaDA's ``generate.py`` (re-implemented):

    * **Blocks** (semi-autoregressive): the answer is split into blocks of ``block_length`` tokens (the last
      one shorter when ``block_length`` does not divide ``gen_length``), filled left to right. ``steps`` is
      spread evenly over the blocks (LLaDA requires it to be a multiple of their number; here earlier blocks
      take the remainder), each block getting at least one step and at most one step per token.
    * **Per step**, a fixed number of tokens is committed: the block's length split evenly over its steps,
      earlier steps taking the remainder (the linear noise schedule makes the expected count per step constant).
      The model predicts every position; a candidate token ``x0`` is drawn at each still-masked position of the
      current block by Gumbel-max at ``temperature`` (0: argmax), and the positions to commit are the
      highest-``confidence`` ones: the softmax probability of ``x0`` (``remasking="low_confidence"``: the
      least confident stay masked) or a uniform draw (``"random"``). Committed tokens are never remasked.
    * **Classifier-free guidance** (``cfg_scale > 0``): the model also sees the sequence with the prompt
      masked out, and the logits are ``uncond + (cfg_scale + 1) * (cond - uncond)``; one batched forward.

    Logits are computed only for the current block (positions after it cannot be committed yet, positions
    before it are all committed), which skips most of the LM-head matmul. ``mask_id`` defaults to the model's
    ``args.mask_token_id``; the prompt must not contain it. Randomness (Gumbel noise, random remasking) is drawn
    from ``generator`` when given (on the model's device). The model is in eval mode during the call.
    """
    if prompt_ids.ndim != 2:
        raise UserError(f"prompt_ids must be a [batch, seq] tensor, got shape {tuple(prompt_ids.shape)}")
    if gen_length <= 0:
        return prompt_ids
    _check_schedule(steps, block_length, temperature, cfg_scale, remasking)
    if mask_id is None:
        mask_id = model.args.mask_token_id
    x, blocks = _masked_answer(model, prompt_ids, gen_length, block_length, mask_id)
    prompt_len = prompt_ids.shape[1]
    was_training = model.training
    model.eval()
    try:
        for (start, end), block_steps in zip(blocks, _even_split(steps, len(blocks))):
            block_steps = min(max(block_steps, 1), end - start)
            # Host ints: the schedule never depends on device values, so the loop has no sync.
            for n_commit in _even_split(end - start, block_steps):
                logits = _block_logits(model, x, prompt_len, start, end, cfg_scale, mask_id)
                # x[:, start:end] is a view: the commit writes into x
                _commit(x[:, start:end], logits, n_commit, temperature, remasking, mask_id, generator)
    finally:
        model.train(was_training)
    return x


def _check_schedule(
    steps: int, block_length: int, temperature: float, cfg_scale: float, remasking: str
) -> None:
    if steps < 1 or block_length < 1:
        raise UserError(
            f"steps and block_length must be >= 1, got steps={steps}, block_length={block_length}"
        )
    if temperature < 0:
        raise UserError(f"temperature must be >= 0, got {temperature}")
    if cfg_scale < 0:
        raise UserError(f"cfg_scale must be >= 0 (0 turns guidance off), got {cfg_scale}")
    if remasking not in _REMASKING:
        raise UserError(f"remasking must be one of {', '.join(_REMASKING)}, got {remasking!r}")


def _check_diffusion_room(model: nn.Module, prompt_len: int, new_tokens: int, name: str) -> None:
    """The prompt and its answer fit the model's positions (the diffusion sampler holds all of them at once);
    ``name`` is the length's name as the caller's user typed it."""
    if _positions(prompt_len, new_tokens, diffusion=True) > model.args.max_seq_len:
        raise UserError(
            f"prompt ({prompt_len} tokens) + {name} ({new_tokens}) exceeds the model's "
            f"max_seq_len={model.args.max_seq_len}; shorten the prompt or {name}"
        )


def _masked_answer(
    model: nn.Module, prompt_ids: torch.Tensor, gen_length: int, block_length: int, mask_id: int
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The prompt followed by ``gen_length`` mask tokens, and the answer's blocks as ``(start, end)`` positions."""
    bsz, prompt_len = prompt_ids.shape
    total = prompt_len + gen_length
    _check_diffusion_room(model, prompt_len, gen_length, "gen_length")
    # One host sync, before the loop: a mask in the prompt would ask for infilling, which this sampler
    # does not do (it would come back still masked).
    if bool((prompt_ids == mask_id).any()):
        raise UserError(f"the prompt contains the mask token (id {mask_id}); remove it")
    x = prompt_ids.new_full((bsz, total), mask_id)
    x[:, :prompt_len] = prompt_ids
    return x, [(s, min(s + block_length, total)) for s in range(prompt_len, total, block_length)]


def _commit(
    block: torch.Tensor,
    logits: torch.Tensor,
    n_commit: int,
    temperature: float,
    remasking: str,
    mask_id: int,
    generator: torch.Generator | None,
) -> None:
    """One denoising step of ``block`` (in place): a candidate at every position, the ``n_commit`` most confident
    of those still masked written."""
    x0 = _gumbel_argmax(logits, temperature, generator)
    if remasking == "low_confidence":
        confidence = logits.softmax(dim=-1).gather(-1, x0[..., None]).squeeze(-1)
    else:
        confidence = torch.rand(x0.shape, device=x0.device, generator=generator)
    confidence = confidence.masked_fill(block != mask_id, float("-inf"))
    pick = confidence.topk(n_commit, dim=-1).indices
    block.scatter_(1, pick, x0.gather(1, pick))


def _even_split(n: int, parts: int) -> list[int]:
    """``n`` split into ``parts`` integers differing by at most one, larger ones first."""
    base, rem = divmod(n, parts)
    return [base + (i < rem) for i in range(parts)]


def _block_logits(
    model: nn.Module, x: torch.Tensor, prompt_len: int, start: int, end: int, cfg_scale: float, mask_id: int
) -> torch.Tensor:
    """fp32 logits ``[B, end - start, V]`` of positions ``start:end``, with classifier-free guidance if asked."""
    if cfg_scale > 0:
        uncond = x.clone()
        uncond[:, :prompt_len] = mask_id
        hidden = model(torch.cat([x, uncond]), return_hidden=True)[:, start:end]
        cond, unc = _head(model, hidden).float().chunk(2)
        return unc + (cfg_scale + 1) * (cond - unc)
    hidden = model(x, return_hidden=True)[:, start:end]
    return _head(model, hidden).float()


def _head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The logits ``forward`` would return for ``hidden``: the LM head, then the model's logit soft-cap if any."""
    return softcap(F.linear(hidden, model.output_weight), getattr(model, "logit_softcap", None))


def _gumbel_argmax(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> torch.Tensor:
    """A sample of ``softmax(logits / temperature)`` per row by Gumbel-max (argmax when ``temperature == 0``).

    LLaDA computes ``argmax(exp(l) / (-log u) ** T)`` in float64 (low-precision Gumbel noise was found to
    degrade generations, arXiv:2409.02908); ``argmax(l - T log(-log u))`` is the same argmax in log space,
    which cannot overflow ``exp``.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    u = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
    return (logits.double() - temperature * torch.log(-torch.log(u))).argmax(dim=-1)


# ------------------------------------------------------------------------------------------- text in, text out


@contextlib.contextmanager
def eager(model: nn.Module) -> Iterator[nn.Module]:
    """Run compiled code eagerly for a while (generation: changing shapes would trigger recompiles)."""
    with torch.compiler.set_stance("force_eager"):
        yield model


class Sampler:
    """Prompt in, text out, for any model of the protocol (or a generic transformers model).

    ``diffusion`` (masked-diffusion families such as LLaDA) is decided once, by the caller, from the family's
    objective: those sample with :func:`diffusion_generate` (one denoising step per token, blocks of 32,
    ``temperature`` as Gumbel noise, ``top_k``/``top_p`` unused) and stop at the first eos; causal models
    decode with their KV cache. ``chat``: the prompt is a user message rendered with the chat template (the
    tokenizer's own, else the SFT default) and only the assistant's answer is returned. Compiled blocks run
    eagerly while sampling (decoding shapes change every token: no recompiles). The keyword defaults given
    here (the trainer's ``sample_*`` settings) apply where a call does not name them; ``system`` too: the system
    message an SFT run's every conversation opened with (its model never saw a chat prompt without it).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        diffusion: bool = False,
        chat: bool = False,
        max_new_tokens: int = 128,
        temperature: float = 0.8,
        top_k: int | None = 50,
        top_p: float | None = None,
        system: str | None = None,
    ) -> None:
        self.model, self.tokenizer, self.diffusion, self.chat = model, tokenizer, diffusion, chat
        self.system = system
        self.defaults = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)

    def prompt_ids(self, prompt: str, chat: bool, system: str | None = None) -> list[int]:
        return self._context(prompt, chat, system)[0]

    def check_room(
        self,
        prompts: Sequence[str],
        flags: tuple[str, str],
        *,
        max_new_tokens: int | None = None,
        chat: bool | None = None,
        system: str | None = None,
    ) -> None:
        """``max_new_tokens`` (default: this sampler's) refused in one line where a sample of one of ``prompts``
        would not fit the model's positions, as generating it would be, with the fix in the options ``flags``
        (new tokens, prompt): checked before a run trains (its samples failed at its end) and before
        ``gptoughts sample`` generates."""
        n = self.defaults["max_new_tokens"] if max_new_tokens is None else max_new_tokens
        if n < 1 or getattr(self.model, "hf_generate", None) is not None:  # (transformers has no such limit)
            return
        limit = self.model.args.max_seq_len
        for prompt in prompts:
            length = len(self.prompt_ids(prompt, self.chat if chat is None else chat, system))
            need = _positions(length, n, self.diffusion)
            if need <= limit:
                continue
            most = n - (need - limit)
            fix = f"pass {flags[0]} {most} or less" if most >= 1 else f"shorten the prompt ({flags[1]})"
            shown = prompt if len(prompt) <= 30 else prompt[:30] + "..."
            raise UserError(
                f"{flags[0]} {n}: the prompt {shown!r} ({length} token{'s' * (length != 1)}) and {n} new tokens need "
                f"{need} positions, beyond the model's {limit}; {fix}"
            )

    def _context(self, prompt: str, chat: bool, system: str | None = None) -> tuple[list[int], int]:
        """The ids the model continues, and how many of them lead the text returned. An empty prompt starts from
        end-of-text, where every document of the corpus starts (the model writes "a document"); that token is
        not the user's and is not printed. ``system``: a system message before the user's, as SFT data holds one
        (chat only: plain text has no turns to put it in); None: this sampler's own, in a chat prompt."""
        if system is None and chat:
            system = self.system
        if system is not None and not chat:
            raise UserError(
                "a system message is a turn of a chat prompt, and this prompt is plain text (no chat template, or "
                "chat off); put its text at the start of the prompt instead"
            )
        if chat:
            from jinja2.exceptions import TemplateError

            from gptoughts.data.sft import render_prompt

            turns = [{"role": "system", "content": system}] if system is not None else []
            try:
                return render_prompt(self.tokenizer, [*turns, {"role": "user", "content": prompt}]), 0
            except TemplateError as e:  # Jinja's raise_exception: "System role not supported"
                if system is None:
                    raise
                reason = " ".join(str(e).split())[:200] or type(e).__name__
                raise UserError(
                    f"the model's chat template refuses a system message ({reason}); put its text at the start of "
                    "the prompt instead"
                ) from None
        ids = self.tokenizer.encode(prompt)
        return (ids, 0) if ids else ([self.tokenizer.eos_id], 1)

    def __call__(
        self,
        prompt: str,
        *,
        seed: int | None = 0,
        chat: bool | None = None,
        system: str | None = None,
        **settings: Any,
    ) -> str:
        """Continue ``prompt``; ``settings`` override max_new_tokens, temperature, top_k, top_p. ``seed`` None
        draws from torch's global generator. ``system``: a system message before the prompt (chat only)."""
        unknown = set(settings) - set(self.defaults)
        if unknown:
            raise TypeError(f"unknown sampling settings {sorted(unknown)}")
        s = {**self.defaults, **settings}
        chat = self.chat if chat is None else chat
        tok = self.tokenizer
        device = compute_device(self.model)
        ids, hidden = self._context(prompt, chat, system)
        from gptoughts.data.sft import turn_end_id

        # A chat template may close answers with its own token rather than eos (ChatML's <|im_end|>): the answer
        # ends there, and what follows is the model playing the next turns.
        end = turn_end_id(tok) if chat and not self.diffusion else None
        x = torch.tensor([ids], dtype=torch.long, device=device)
        g = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        with eager(self.model):
            if self.diffusion:
                n = s["max_new_tokens"]
                _check_diffusion_room(self.model, len(ids), n, "max_new_tokens")
                out = diffusion_generate(
                    self.model,
                    x,
                    gen_length=n,
                    steps=n,
                    block_length=min(32, n),
                    temperature=s["temperature"],
                    mask_id=tok.mask_id,
                    generator=g,
                )
                return tok.decode(_until_eos(out[0].tolist(), len(ids), tok.eos_id)[hidden:])
            out = generate(
                self.model,
                x,
                s["max_new_tokens"],
                temperature=s["temperature"],
                top_k=s["top_k"],
                top_p=s["top_p"],
                eos_id=tok.eos_id,
                generator=g,
                end_ids=() if end is None else (end,),
            )
        if chat:
            answer = out[0].tolist()[len(ids) :]
            return tok.decode(
                answer[: answer.index(end)] if end in answer else answer, skip_special_tokens=True
            )
        return tok.decode(out[0].tolist()[hidden:])


def _until_eos(ids: list[int], prompt_len: int, eos_id: int) -> list[int]:
    """``ids`` up to and including the first eos after the prompt: a diffusion sample has a fixed length, and
    what follows an eos belongs to another document (the causal sampler stops there)."""
    try:
        return ids[: ids.index(eos_id, prompt_len) + 1]
    except ValueError:
        return ids
