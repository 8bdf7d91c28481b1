from __future__ import annotations

import json
from pathlib import Path

import pytest

from gptoughts.data.tokenizer import Tokenizer, build_tokenizer, bytes_tokenizer
from gptoughts.errors import ConfigError

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "Le chat est sur le tapis. Où est le chien ? 🐕\n",
    "import numpy as np\nx = np.zeros((3, 4))\nprint(x.shape)\n",
] * 20
SAMPLE = "naïve café 🙂 def f(x):\n\treturn x  # ok\n"


def test_bytes_tokenizer_round_trip() -> None:
    tok = bytes_tokenizer()
    assert (tok.vocab_size, tok.eos_id, tok.pad_id, tok.mask_id, tok.bos_id) == (259, 0, 1, 2, None)
    ids = tok.encode(SAMPLE)
    assert ids == [3 + b for b in SAMPLE.encode("utf-8")]
    assert tok.decode(ids) == SAMPLE
    assert tok.encode_batch([SAMPLE, "x"]) == [ids, [3 + ord("x")]]


def test_bytes_fast_path_matches_the_library() -> None:
    tok = bytes_tokenizer()
    text = SAMPLE + "<|endoftext|><|pad|>" + "".join(chr(c) for c in range(1, 3000, 7))
    tok.backend.encode_special_tokens = True  # plain-text semantics, as the fast path
    assert tok.encode(text) == tok.backend.encode(text, add_special_tokens=False).ids


def test_special_strings_in_text_are_plain_text_by_default() -> None:
    tok = build_tokenizer("bpe:400", lambda: iter(TEXTS))
    text = "a<|endoftext|>b"
    assert tok.eos_id not in tok.encode(text)
    assert tok.eos_id in tok.encode(text, special=True)
    assert tok.decode(tok.encode(text)) == text


def test_bpe_training_round_trip_and_determinism() -> None:
    tok = build_tokenizer("bpe:400", lambda: iter(TEXTS))
    assert tok.vocab_size <= 400 and tok.vocab_size > 259
    assert (tok.eos_id, tok.pad_id, tok.mask_id) == (0, 1, 2)
    assert [tok.id_to_token(i) for i in range(3)] == ["<|endoftext|>", "<|pad|>", "<|mask|>"]
    ids = tok.encode(SAMPLE)
    assert tok.decode(ids) == SAMPLE
    assert len(tok.encode(TEXTS[0])) < len(TEXTS[0].encode())  # merges were learnt
    again = build_tokenizer("bpe:400", lambda: iter(TEXTS))
    assert again.fingerprint() == tok.fingerprint()
    assert tok.encode_batch(TEXTS[:3]) == [tok.encode(t) for t in TEXTS[:3]]


def test_save_loads_in_transformers_and_back(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = build_tokenizer("bpe:400", lambda: iter(TEXTS))
    tok.save(tmp_path / "tk")
    assert {p.name for p in (tmp_path / "tk").iterdir()} >= {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "tk"))
    for text in TEXTS[:3] + [SAMPLE]:
        assert hf(text)["input_ids"] == tok.encode(text)
    assert (hf.eos_token_id, hf.pad_token_id, hf.mask_token_id) == (0, 1, 2)
    back = Tokenizer.load(tmp_path / "tk")
    assert back.fingerprint() == tok.fingerprint()
    assert back.encode(SAMPLE) == tok.encode(SAMPLE)
    assert back.chat_template is None


def test_save_with_a_chat_template_loads_in_transformers_without_importing_it(tmp_path: Path) -> None:
    # save() writes its JSON files itself (importing transformers cost ~1 s of every run's start-up); the files
    # stay what transformers reads: the template too, and a later save without one removes the stale file.
    import subprocess
    import sys

    tok = build_tokenizer("bpe:400", lambda: iter(TEXTS))
    tok._chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    code = (
        "import sys; from gptoughts.data.tokenizer import Tokenizer; "
        f"Tokenizer.load({str(tmp_path / 'src')!r}).save({str(tmp_path / 'tk')!r}); "
        "assert 'transformers' not in sys.modules, 'save imported transformers'"
    )
    tok.save(tmp_path / "src")
    subprocess.run([sys.executable, "-c", code], check=True)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path / "tk"))
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert hf.apply_chat_template(msgs, tokenize=False) == "<user>hi<assistant>yo"
    assert hf(SAMPLE)["input_ids"] == tok.encode(SAMPLE)
    assert (hf.eos_token_id, hf.pad_token_id, hf.mask_token_id, hf.bos_token) == (0, 1, 2, None)
    tok._chat_template = None
    tok.save(tmp_path / "tk")
    assert not (tmp_path / "tk" / "chat_template.jinja").exists()
    assert Tokenizer.load(tmp_path / "tk").chat_template is None


def test_hf_folder_with_bos_and_chat_template(tmp_path: Path) -> None:
    # A Llama-like folder: distinct bos, eos named in the config, a chat template in a .jinja file.
    base = bytes_tokenizer()
    base.backend.add_special_tokens(["<s>", "</s>"])
    folder = tmp_path / "llama_like"
    folder.mkdir()
    base.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"})
    )
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tok = build_tokenizer(str(folder), None)
    assert tok.bos_id == 259 and tok.eos_id == 260 and tok.vocab_size == 261 and tok.pad_id is None
    assert tok.chat_template is not None and "messages" in tok.chat_template
    assert not tok._is_bytes  # extra tokens: no byte fast path
    assert tok.encode("hi") == [3 + ord("h"), 3 + ord("i")]
    saved = Tokenizer.load(tok.save(tmp_path / "saved"))
    assert saved.fingerprint() == tok.fingerprint() and saved.chat_template == tok.chat_template
    assert saved.bos_id == 259 and saved.eos_id == 260


def test_eos_from_model_config(tmp_path: Path) -> None:
    base = bytes_tokenizer()
    folder = tmp_path / "m"
    folder.mkdir()
    base.backend.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": [1, 0]}))
    assert Tokenizer.load(folder).eos_id == 1


@pytest.mark.parametrize("spec", ["bpe", "bpe:abc", "gpt2", "/no/such/folder", "byte"])
def test_bad_spec(spec: str) -> None:
    with pytest.raises(
        ConfigError, match="--tokenizer must be bpe:VOCAB, bytes, or a folder with tokenizer.json"
    ):
        build_tokenizer(spec, None)


def test_bpe_vocab_too_small() -> None:
    with pytest.raises(ConfigError, match="at least 259"):
        build_tokenizer("bpe:100", lambda: iter(TEXTS))
