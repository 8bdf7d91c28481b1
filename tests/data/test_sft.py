"""SFT data: JSONL parsing, chat rendering, loss masks, truncation, packing, the resumable rank-aware loader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gptoughts.data.sft import IGNORE_INDEX, SFTData, SFTLoader, render_prompt, resolve_format
from gptoughts.data.tokenizer import EOS_TOKEN, MASK_TOKEN, PAD_TOKEN, Tokenizer, _bytes_backend
from gptoughts.errors import ConfigError, DataError

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tok(template: str | None = None) -> Tokenizer:
    backend = _bytes_backend()
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return Tokenizer(
        backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        mask_token=MASK_TOKEN,
        chat_template=template,
        spec="test",
    )


def _write(path: Path, records: list) -> Path:
    path.write_text("\n".join(json.dumps(r) if not isinstance(r, str) else r for r in records) + "\n")
    return path


def _pairs(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "prompt": "q" * int(rng.integers(1, 12)) + f" {i}?",
            "response": "a" * int(rng.integers(1, 10)) + ".",
        }
        for i in range(n)
    ]


def _targets(data: SFTData, e: int) -> tuple[list[int], list[int]]:
    s, t = int(data.offsets[e]), int(data.offsets[e + 1])
    return data.x_tokens[s:t].tolist(), [int(v) for v in data.y_tokens[s:t] if v != IGNORE_INDEX]


@pytest.mark.parametrize("template", [None, CHATML])
def test_loss_only_on_response_tokens(tmp_path, template):
    src = _write(
        tmp_path / "d.jsonl",
        [
            {"prompt": "What is two plus two?", "response": "Four."},
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "Bye"},
                    {"role": "assistant", "content": "Ciao."},
                ]
            },
        ],
    )
    tok = _tok(template)
    data = SFTData([str(src)], tok, block_size=256)
    end = (
        "<|im_end|>\n" if template else EOS_TOKEN
    )  # ChatML ends a turn with <|im_end|>; the default with eos
    ids, tgt = _targets(data, 0)
    assert tok.decode(tgt) == "Four." + end
    full = tok.decode(ids)
    assert full.endswith("Four." + end) and "What is two plus two?" in full
    _, tgt = _targets(data, 1)
    assert tok.decode(tgt) == "Hello." + end + "Ciao." + end  # every assistant turn, nothing else
    if template is None:
        assert full.startswith("<|user|>\nWhat is two plus two?\n<|assistant|>\nFour.")
    # the prompt a sampler feeds is exactly the context before the answer
    prompt = render_prompt(tok, [{"role": "user", "content": "What is two plus two?"}])
    assert ids[: len(prompt)] == prompt and tok.decode(ids[len(prompt) :]) == "Four." + end


def test_bad_records_name_the_line(tmp_path):
    src = _write(tmp_path / "bad.jsonl", [{"prompt": "a", "response": "b"}, {"text": "plain"}])
    with pytest.raises(DataError, match=r"bad\.jsonl:2: .*\"prompt\".*\"messages\""):
        SFTData([str(src)], _tok(), block_size=64)
    _write(src, [{"prompt": "a", "response": "b"}, "{not json"])
    with pytest.raises(DataError, match=r"bad\.jsonl:2: invalid JSON"):
        SFTData([str(src)], _tok(), block_size=64)
    _write(src, [{"messages": [{"role": "user", "content": "only a question"}]}])
    with pytest.raises(DataError, match="no assistant message"):
        SFTData([str(src)], _tok(), block_size=64)
    # answers under another role name (Gemma's "model", ShareGPT's "gpt"): the line says which roles it has
    _write(src, [{"messages": [{"role": "user", "content": "hi"}, {"role": "model", "content": "yo"}]}])
    with pytest.raises(DataError, match=r'roles: user, model\); an answer has role "assistant"'):
        SFTData([str(src)], _tok(), block_size=64)


def test_format_detection(tmp_path):
    sft = _write(tmp_path / "sft.jsonl", _pairs(3))
    text = _write(tmp_path / "text.jsonl", [{"text": "hello"}])
    plain = tmp_path / "a.txt"
    plain.write_text("hello")
    assert resolve_format("auto", [str(sft)]) == "sft"
    assert resolve_format("auto", [str(text)]) == "text"
    assert resolve_format("auto", [str(plain)]) == "text"
    assert resolve_format("sft", [str(plain)]) == "sft"
    with pytest.raises(ConfigError, match="mixes"):
        resolve_format("auto", [str(sft), str(plain)])


def test_truncation_policy_is_counted(tmp_path):
    src = _write(
        tmp_path / "d.jsonl",
        [
            {"prompt": "short", "response": "ok"},
            {"prompt": "p", "response": "r" * 100},  # too long, but the cut keeps response tokens
            {"prompt": "p" * 100, "response": "r"},  # too long, and the cut removes the whole response
        ],
    )
    right = SFTData([str(src)], _tok(), block_size=32, truncation="right")
    assert right.stats["truncated"] == 2 and right.stats["dropped_no_target"] == 1
    assert len(right.pairs) == 2 and right.pairs.max() == 32
    drop = SFTData([str(src)], _tok(), block_size=32, truncation="drop")
    assert drop.stats["dropped_too_long"] == 2 and len(drop.pairs) == 1
    assert "dropped as too long" in drop.summary()


def test_no_usable_example_names_what_removed_the_answers(tmp_path):
    """Every example cut at block_size+1 before its answer (a long system prompt) was reported as "0 longer than
    block_size+1, 1 without response tokens; ... use data.truncation = right", the setting already in use."""
    long_prompt = _write(tmp_path / "a.jsonl", [{"system": "s" * 60, "prompt": "p", "response": "r"}])
    with pytest.raises(DataError) as e:
        SFTData([str(long_prompt)], _tok(CHATML), block_size=32, truncation="right")
    assert "1 cut at block_size+1 = 33 tokens before their answer" in str(e.value)
    assert "raise --block_size" in str(e.value) and "truncation" not in str(e.value)
    with pytest.raises(DataError, match="1 dropped as longer than .* data.truncation = right"):
        SFTData([str(long_prompt)], _tok(CHATML), block_size=32, truncation="drop")


def test_packing_rows_keep_examples_whole(tmp_path):
    src = _write(tmp_path / "d.jsonl", _pairs(60))
    data = SFTData([str(src)], _tok(), block_size=128, seed=0)
    loader = SFTLoader(data, batch_size=4, seed=3)
    rows = loader._epoch_rows(0)
    assert sorted(np.concatenate(rows).tolist()) == sorted(data.train_idx.tolist())  # each example once
    assert all(data.pairs[r].sum() <= 128 for r in rows)
    assert len(rows) < len(data.train_idx) / 2  # several examples per row
    x, y, pos, doc = next(loader)
    assert x.shape == y.shape == pos.shape == doc.shape == (4, 128) and x.dtype == torch.int64
    for b in range(4):
        for k in range(int(doc[b].max()) + 1):
            sel = doc[b] == k
            idx = sel.nonzero().flatten()
            assert torch.equal(idx, torch.arange(int(idx[0]), int(idx[-1]) + 1))  # contiguous
            assert torch.equal(pos[b, sel], torch.arange(int(sel.sum())))  # positions restart per document
        # the last document of a row is padding: no loss
        tail = doc[b] == doc[b].max()
        if data.pairs[rows[b]].sum() < 128:
            assert (y[b, tail] == IGNORE_INDEX).all()
    unpacked = SFTLoader(data, batch_size=4, seed=3, packing=False)
    assert len(unpacked._epoch_rows(0)) == len(data.train_idx)
    assert len(next(unpacked)) == 2  # (x, y): right padding needs neither positions nor a document mask


def test_loader_resume_epochs_and_ranks(tmp_path):
    src = _write(tmp_path / "d.jsonl", _pairs(40))
    data = SFTData([str(src)], _tok(), block_size=96, val_fraction=0.1, seed=0)
    assert len(data.val_idx) == 4 and not set(data.val_idx) & set(data.train_idx)
    ref = SFTLoader(data, batch_size=2, seed=1)
    stream = [next(ref) for _ in range(12)]  # crosses epochs: a few rows per epoch
    assert ref.epoch > 1.0
    a = SFTLoader(data, batch_size=2, seed=1)
    for _ in range(5):
        next(a)
    sd = a.state_dict()
    assert all(isinstance(v, (int, bool)) for k, v in sd.items() if k != "kind")
    b = SFTLoader(data, batch_size=2, seed=1)
    b.load_state_dict(sd)
    for want in stream[5:]:
        got = next(b)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    # two ranks of batch 1 see the rows of one process of batch 2, split between them
    r0 = SFTLoader(data, batch_size=1, seed=1, rank=0, world_size=2)
    r1 = SFTLoader(data, batch_size=1, seed=1, rank=1, world_size=2)
    for want in stream[:3]:
        assert torch.equal(torch.cat([next(r0)[0], next(r1)[0]]), want[0])
    with pytest.raises(ConfigError, match="seed"):
        SFTLoader(data, batch_size=2, seed=2).load_state_dict(sd)
    other = SFTLoader(data, batch_size=2, seed=5)
    assert not torch.equal(next(other)[0], stream[0][0])
    evals = list(data.eval_batches(batch_size=2, max_batches=None))
    assert evals and all(len(b) == 4 for b in evals)
    assert all(
        torch.equal(p, q) for p, q in zip(evals[0], next(data.eval_batches(batch_size=2, max_batches=1)))
    )


def test_byte_order_mark_and_invalid_utf8_in_sft_jsonl(tmp_path: Path) -> None:
    from gptoughts.data.sft import read_conversations, resolve_format

    p = tmp_path / "chat.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"prompt": "hi \xff", "response": "hello"}\n')  # BOM + an invalid byte
    assert resolve_format("auto", [str(p)]) == "sft"  # the BOM used to hide the record: "text"
    (conv,) = read_conversations([str(p)])  # used to raise UnicodeDecodeError
    assert conv[0]["content"] == "hi \ufffd" and conv[1]["content"] == "hello"
