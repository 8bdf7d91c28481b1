"""Tokenizers: byte-level, trained byte-level BPE, or a local Hugging Face tokenizer folder.

Every kind is a :class:`tokenizers.Tokenizer` underneath (the Rust library does the work, in parallel), wrapped
by :class:`Tokenizer`, which knows the special-token roles (eos, pad, bos, mask) and saves itself in the
format ``transformers.AutoTokenizer.from_pretrained`` reads. Our own tokenizers reserve
``<|endoftext|>`` = 0 (eos, also the document separator), ``<|pad|>`` = 1 and ``<|mask|>`` = 2 (the mask
token of masked-diffusion objectives) and have no bos.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from gptoughts.errors import ConfigError, DataError, as_disk_full

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN)  # ids 0, 1, 2 in our own tokenizers
MIN_BPE_VOCAB = len(SPECIAL_TOKENS) + 256
_BYTE_OFFSET = len(SPECIAL_TOKENS)  # byte b is token 3 + b in the bytes tokenizer
_OUR_ROLES: dict[str, str | None] = {"eos": EOS_TOKEN, "pad": PAD_TOKEN, "bos": None, "mask": MASK_TOKEN}
# End-of-text tokens recognised in a bare tokenizer.json that comes without a tokenizer_config.json.
_KNOWN_EOS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "<|eot_id|>")
_SPEC_HELP = "--tokenizer must be bpe:VOCAB, bytes, or a folder with tokenizer.json; got"
# Documents per call of the trainer's input iterator (lets the Rust side batch its work).
_TRAIN_BATCH_DOCS = 256


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the alphabet of the ByteLevel pre-tokenizer)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _byte_level(tk: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    # add_prefix_space=False: a document's first word is not silently changed; the GPT-2 regex groups
    # letters, digits, punctuation and whitespace runs (indentation in code stays one pre-token).
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    return tk


def _special_token_str(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus its special-token roles; the one tokenizer type of gptoughts."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_token: str,
        pad_token: str | None = None,
        bos_token: str | None = None,
        mask_token: str | None = None,
        chat_template: str | None = None,
        spec: str = "",
        source_dir: str | Path | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        self.backend = backend
        self.spec = spec
        self.source_dir = Path(source_dir) if source_dir is not None else None
        # Whether the source folder's own tokenizer class (auto_map) may run: the user's --trust_remote_code.
        self.trust_remote_code = trust_remote_code
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.bos_token = bos_token
        self.mask_token = mask_token
        self._chat_template = chat_template
        self._hf: Any = None
        eos_id = backend.token_to_id(eos_token)
        if eos_id is None:
            where = f" at {source_dir}" if source_dir else ""
            raise ConfigError(
                f"tokenizer{where} has no token {eos_token!r} for eos; set eos_token in tokenizer_config.json"
            )
        self.eos_id: int = eos_id
        self.pad_id: int | None = backend.token_to_id(pad_token) if pad_token else None
        self.bos_id: int | None = backend.token_to_id(bos_token) if bos_token else None
        self.mask_id: int | None = backend.token_to_id(mask_token) if mask_token else None
        # max id + 1, not get_vocab_size(): added tokens may leave holes in the id space.
        self.vocab_size: int = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        # The bytes tokenizer (built here or loaded back from disk) gets a numpy fast path.
        self._is_bytes = self.vocab_size == MIN_BPE_VOCAB and self.fingerprint() == _bytes_fingerprint()

    @property
    def is_bytes(self) -> bool:
        """The bytes tokenizer (encoded by numpy at memory speed rather than by the library)."""
        return self._is_bytes

    # ------------------------------------------------------------------------------------- encoding

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        """Token ids of ``text``; nothing is added around it (prepare appends eos after each document).

        By default special-token strings inside the text (a literal ``<|endoftext|>`` in a corpus about
        tokenizers) are encoded as plain text, so data cannot inject document separators; ``special=True``
        maps them to their ids (chat templates, prompts written with specials).
        """
        if self._is_bytes and not special:
            return (
                np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) + _BYTE_OFFSET
            ).tolist()
        self.backend.encode_special_tokens = not special
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], *, special: bool = False) -> list[list[int]]:
        """Token ids of many texts, encoded in parallel by the Rust library (GIL released meanwhile)."""
        return [a.tolist() for a in self.encode_batch_numpy(texts, special=special)]

    def encode_batch_numpy(
        self, texts: Sequence[str], *, special: bool = False, dtype: np.typing.DTypeLike = np.int64
    ) -> list[np.ndarray]:
        """Like :meth:`encode_batch`, one numpy array per text (what prepare writes to shards)."""
        if self._is_bytes and not special:
            # Measured: the library's byte-level path runs at ~1.7 MB/s on 2 cores (regex pre-tokenizer
            # plus a BPE lookup per byte) while this exact equivalent (byte b -> id 3 + b) runs at memory
            # speed; tests check both give the same ids.
            return [
                np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(dtype) + _BYTE_OFFSET for t in texts
            ]
        _enable_rust_parallelism()
        self.backend.encode_special_tokens = not special
        # encode_batch_fast skips the offsets bookkeeping we never use (~1.5x faster, measured).
        fn = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        return [np.asarray(e.ids, dtype=dtype) for e in fn(list(texts), add_special_tokens=False)]

    def encode_batch_offsets(
        self, texts: Sequence[str], *, special: bool = False
    ) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """``(ids, character offsets)`` of each text, encoded in parallel; the bytes tokenizer (one token a byte of
        the UTF-8 text, its offsets implied) gives empty offsets. What SFT needs to mark a token as a target where
        it overlaps an answer's characters."""
        if self._is_bytes and not special:
            return [(ids, []) for ids in self.encode_batch(texts)]
        _enable_rust_parallelism()
        self.backend.encode_special_tokens = not special
        return [(e.ids, e.offsets) for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(i)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer(spec={self.spec!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"

    # ------------------------------------------------------------------------------------- identity

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template of a loaded HF tokenizer (None for our own tokenizers)."""
        return self._chat_template

    @property
    def hf(self) -> Any:
        """The ``transformers`` tokenizer for the same vocabulary (for ``apply_chat_template``); lazy.

        Loaded from the source folder when there is one (so model-specific classes keep their quirks), else
        a ``PreTrainedTokenizerFast`` around a copy of the backend.
        """
        if self._hf is None:
            if self.source_dir is not None:
                self._hf = _auto_tokenizer(self.source_dir, self.trust_remote_code)
            else:
                self._hf = self._to_hf()
        return self._hf

    def _roles(self) -> dict[str, str | None]:
        return {"eos": self.eos_token, "pad": self.pad_token, "bos": self.bos_token, "mask": self.mask_token}

    def canonical_json(self) -> str:
        """The serialized tokenizer with sorted keys, without runtime settings (truncation, padding)."""
        return _canonical_json(self.backend, self._roles())

    def fingerprint(self) -> str:
        """sha256 of :meth:`canonical_json`: equal fingerprints encode identically."""
        return _fingerprint(self.canonical_json())

    # ------------------------------------------------------------------------------------- save / load

    def _to_hf(self) -> Any:
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(
            tokenizer_object=tokenizers.Tokenizer.from_str(self.backend.to_str()),  # a copy: HF may edit it
            eos_token=self.eos_token,
            pad_token=self.pad_token,
            bos_token=self.bos_token,
            mask_token=self.mask_token,
        )
        if self._chat_template:
            hf.chat_template = self._chat_template
        return hf

    def save(self, directory: str | Path) -> Path:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

        ``transformers.AutoTokenizer.from_pretrained(directory)`` loads the result, and so does
        :meth:`load`, with the same :meth:`fingerprint`.
        """
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        # Written directly, not through transformers' save_pretrained: importing transformers took ~1 s of every
        # run's start-up (1.2 of 3.8 s of a debug run's assembly on this CPU) for three small JSON files. The
        # files are the ones transformers 5 writes for a PreTrainedTokenizerFast (a test loads them with
        # AutoTokenizer); "PreTrainedTokenizerFast" rather than 5.x's "TokenizersBackend", which 4.x cannot
        # resolve.
        try:
            self.backend.save(str(d / "tokenizer.json"))
        except Exception as e:  # tokenizers' Rust raises a bare Exception, even for a full disk
            full = as_disk_full(e, d / "tokenizer.json")
            if full is None:
                raise
            raise full from None
        roles = {f"{k}_token": v for k, v in self._roles().items()}
        specials = {k: v for k, v in roles.items() if v is not None}
        cfg = {
            "backend": "tokenizers",
            **roles,
            "model_max_length": int(1e30),  # transformers' VERY_LARGE_INTEGER: no limit of its own
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        (d / "tokenizer_config.json").write_text(
            json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8"
        )
        template = d / "chat_template.jinja"  # where transformers >= 4.43 saves (and reads) the template
        if self._chat_template:
            template.write_text(self._chat_template, encoding="utf-8")
        elif template.is_file():
            template.unlink()
        (d / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n", encoding="utf-8")
        return d

    @classmethod
    def load(
        cls, directory: str | Path, *, spec: str | None = None, trust_remote_code: bool = False
    ) -> Tokenizer:
        """Load a tokenizer folder (ours, or any local Hugging Face tokenizer/model folder); ``trust_remote_code``
        lets transformers run the folder's own tokenizer class where one is needed (off unless the user asks)."""
        d = Path(directory).expanduser()
        if not d.is_dir():
            raise ConfigError(f"{_SPEC_HELP} {str(directory)!r} (no such folder)")
        cfg = _read_json(d / "tokenizer_config.json")
        smap = _read_json(d / "special_tokens_map.json")

        def role(name: str) -> str | None:
            return _special_token_str(cfg.get(name)) or _special_token_str(smap.get(name))

        roles = {name: role(name) for name in ("eos_token", "pad_token", "bos_token", "mask_token")}
        template = _read_chat_template(d, cfg)
        if (d / "tokenizer.json").is_file():
            backend = _backend_from_file(d / "tokenizer.json")
        else:
            backend, roles, template = _load_with_transformers(d, roles, template, trust_remote_code)
        if roles["eos_token"] is None:
            roles["eos_token"] = _eos_from_model_config(d, backend)
        if roles["eos_token"] is None:
            raise ConfigError(
                f'tokenizer at {d} defines no eos token; add "eos_token" to its tokenizer_config.json'
            )
        return cls(
            backend,
            eos_token=roles["eos_token"],
            pad_token=roles["pad_token"],
            bos_token=roles["bos_token"],
            mask_token=roles["mask_token"],
            chat_template=template,
            spec=spec if spec is not None else str(d),
            source_dir=d,
            trust_remote_code=trust_remote_code,
        )


def _backend_from_file(path: Path) -> tokenizers.Tokenizer:
    """``tokenizers.Tokenizer.from_file``, with a damaged file reported as a one-line DataError."""
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception for any parse or schema error
        reason = " ".join(str(e).split())[:160]
        raise DataError(
            f"{path} is not a valid tokenizer file ({reason}); replace it with a good copy or pass another "
            f"tokenizer"
        ) from None


def _canonical_json(backend: tokenizers.Tokenizer, roles: dict[str, str | None]) -> str:
    data = json.loads(backend.to_str())
    data.pop("truncation", None)
    data.pop("padding", None)
    # The roles are part of the identity: the eos id is written between documents.
    return json.dumps(
        {"tokenizer": data, "roles": roles}, sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )


def _fingerprint(canonical: str) -> str:
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _enable_rust_parallelism() -> None:
    # Unset, the Rust pool is used anyway, but the first later fork (torch.compile's worker pool, a
    # DataLoader worker) prints a warning and turns parallelism off. Setting it explicitly keeps the pool
    # and silences that; those forks exec or never tokenize. A user's explicit "false" is respected.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")


def _read_chat_template(d: Path, cfg: dict) -> str | None:
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    if isinstance(tpl, str):
        return tpl
    if (d / "chat_template.jinja").is_file():  # transformers >= 4.43 saves it beside the config
        return (d / "chat_template.jinja").read_text(encoding="utf-8")
    tpl = _read_json(d / "chat_template.json").get("chat_template")
    return tpl if isinstance(tpl, str) else None


def _auto_tokenizer(d: Path, trust_remote_code: bool) -> Any:
    """``AutoTokenizer.from_pretrained(d)``; a folder whose tokenizer is a class of its own, refused for want of
    ``trust_remote_code``, is a one-line ConfigError naming the flag."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(d), trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e) and not trust_remote_code:
            raise ConfigError(
                f"the tokenizer of {d} is a class of its own (auto_map in tokenizer_config.json) whose Python code "
                "must run to load it; pass --trust_remote_code if you trust that code"
            ) from None
        raise


def _load_with_transformers(
    d: Path, roles: dict[str, str | None], template: str | None, trust_remote_code: bool
) -> tuple[tokenizers.Tokenizer, dict[str, str | None], str | None]:
    """Fallback for folders without tokenizer.json (e.g. sentencepiece only): let transformers convert it."""
    try:
        hf = _auto_tokenizer(d, trust_remote_code)
    except ConfigError:
        raise
    except Exception as e:  # transformers raises many types here (OSError, ValueError, ImportError...)
        raise ConfigError(f"{_SPEC_HELP} {str(d)!r} (transformers could not load it: {e})") from None
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError(
            f"{_SPEC_HELP} {str(d)!r} (only a slow tokenizer is available; add a tokenizer.json)"
        )
    for name in roles:
        roles[name] = roles[name] or getattr(hf, name, None)
    return backend, roles, template or getattr(hf, "chat_template", None)


def _eos_from_model_config(d: Path, backend: tokenizers.Tokenizer) -> str | None:
    for name in ("generation_config.json", "config.json"):
        eid = _read_json(d / name).get("eos_token_id")
        if isinstance(eid, list):
            eid = eid[0] if eid else None
        if isinstance(eid, int) and backend.id_to_token(eid) is not None:
            return backend.id_to_token(eid)
    vocab = backend.get_vocab(with_added_tokens=True)
    return next((t for t in _KNOWN_EOS if t in vocab), None)


# ------------------------------------------------------------------------------------------ building


def _bytes_backend() -> tokenizers.Tokenizer:
    b2u = _bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({b2u[b]: _BYTE_OFFSET + b for b in range(256)})
    tk = _byte_level(tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[])))
    tk.add_special_tokens(list(SPECIAL_TOKENS))
    return tk


@functools.cache
def _bytes_fingerprint() -> str:
    return _fingerprint(_canonical_json(_bytes_backend(), _OUR_ROLES))


def bytes_tokenizer() -> Tokenizer:
    """256 byte tokens after our 3 specials; a BPE model without merges, so the class (and the HF loading
    path) is the same as for trained tokenizers."""
    return Tokenizer(
        _bytes_backend(), eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, mask_token=MASK_TOKEN, spec="bytes"
    )


def train_bpe(texts: Iterable[str], vocab_size: int, *, spec: str | None = None) -> Tokenizer:
    """Train a byte-level BPE of ``vocab_size`` tokens (specials and the 256 bytes included).

    Deterministic for the same texts in the same order. A corpus too small to yield that many merges gives a
    smaller vocabulary (``Tokenizer.vocab_size`` tells).
    """
    if vocab_size < MIN_BPE_VOCAB:
        raise ConfigError(
            f"bpe vocab must be at least {MIN_BPE_VOCAB} (3 specials + 256 bytes); got bpe:{vocab_size}"
        )
    tk = _byte_level(tokenizers.Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,  # a merge seen once is noise, not vocabulary
        special_tokens=list(SPECIAL_TOKENS),  # first, so they get ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable, even unseen ones
        show_progress=False,
    )
    _enable_rust_parallelism()
    tk.train_from_iterator(_batched(texts, _TRAIN_BATCH_DOCS), trainer=trainer)
    tok = Tokenizer(
        tk, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, mask_token=MASK_TOKEN, spec=spec or f"bpe:{vocab_size}"
    )
    assert tok.eos_id == 0 and tok.pad_id == 1 and tok.mask_id == 2, "BpeTrainer must put specials first"
    return tok


def _batched(texts: Iterable[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for t in texts:
        batch.append(t)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


_BPE_RE = re.compile(r"bpe:(\d+)")


def parse_spec(spec: str) -> tuple[str, int | None]:
    """``("bytes", None)``, ``("bpe", VOCAB)`` or ``("folder", None)``; ConfigError for anything else."""
    s = str(spec).strip()
    if s == "bytes":
        return "bytes", None
    m = _BPE_RE.fullmatch(s)
    if m:
        vocab = int(m.group(1))
        if vocab < MIN_BPE_VOCAB:
            raise ConfigError(f"bpe vocab must be at least {MIN_BPE_VOCAB} (3 specials + 256 bytes); got {s}")
        return "bpe", vocab
    p = Path(s).expanduser()
    if p.is_dir() and any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return "folder", None
    if (p / "tokenizer" / "tokenizer.json").is_file():  # a prepared dataset or a run: its tokenizer is inside
        raise ConfigError(
            f"{_SPEC_HELP} {s!r}, whose tokenizer is in its tokenizer/ folder: pass {p / 'tokenizer'}"
        )
    raise ConfigError(f"{_SPEC_HELP} {s!r}")


def tokenizer_before_training(spec: str, *, trust_remote_code: bool = False) -> tuple[Tokenizer | None, int]:
    """What ``spec`` gives before any corpus is read: the tokenizer of ``bytes`` or a folder and its vocabulary, or
    ``(None, VOCAB)`` for ``bpe:VOCAB`` (trained on the corpus later; VOCAB unless the corpus is too small)."""
    kind, vocab = parse_spec(spec)
    if kind == "bpe":
        assert vocab is not None
        return None, vocab
    tok = bytes_tokenizer() if kind == "bytes" else Tokenizer.load(spec, trust_remote_code=trust_remote_code)
    return tok, tok.vocab_size


def build_tokenizer(
    spec: str, texts: Callable[[], Iterator[str]] | None = None, *, trust_remote_code: bool = False
) -> Tokenizer:
    """Build the tokenizer a spec names: ``bytes``, ``bpe:VOCAB`` (trained on ``texts()``) or a folder (a model's,
    whose own tokenizer class runs only with ``trust_remote_code``)."""
    kind, vocab = parse_spec(spec)
    if kind == "bytes":
        return bytes_tokenizer()
    if kind == "bpe":
        if texts is None:
            raise ConfigError(f"--tokenizer {spec} trains on the corpus, but no training text was given")
        assert vocab is not None
        return train_bpe(texts(), vocab, spec=str(spec).strip())
    return Tokenizer.load(str(spec).strip(), spec=str(spec).strip(), trust_remote_code=trust_remote_code)
