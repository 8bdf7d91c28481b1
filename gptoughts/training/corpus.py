"""The data step of the assembly: sources -> tokenizer -> token shards (or SFT examples), and the corpus's facts
the plan reads (its size, estimated before anything is tokenized)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gptoughts.config import Config
from gptoughts.data.sources import STDLIB_ALIAS, stdlib_path
from gptoughts.errors import ConfigError, UserError
from gptoughts.parallel import dist as pdist
from gptoughts.training.environment import Environment


@dataclass
class Data:
    sources: list[str]
    """Resolved paths (``@stdlib`` expanded)."""
    format: str
    """text (token shards), sft (examples with a target mask) or prefs (preference pairs)."""
    tokenizer: Any
    manifest: Any = None
    """The prepared shards' Manifest (text runs, once prepared)."""
    sft: Any = None
    """SFTData (sft runs)."""
    prefs: Any = None
    """PrefData (preference tuning, ``train.objective = dpo``)."""
    init_from: Path | None = None
    estimated: bool = False
    """Dry run with no cached shards: token counts are estimated from the corpus size, nothing was tokenized."""
    corpus: dict[str, Any] = field(default_factory=dict)
    """What the plan reports: files, bytes on disk, bytes read, tokens, what a cap cut."""

    @property
    def dataset(self) -> Any:
        from gptoughts.data.loader import TokenDataset

        return TokenDataset(self.manifest.dir) if self.manifest is not None else None

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size) if self.tokenizer is not None else int(self.corpus["vocab"])

    def sample_prompts(self, asked: list[str] | None) -> list[str]:
        """``eval.sample_prompts`` for this data: as asked, or (None) the start of the corpus's first line (the
        training split starts a document; the held-out one may start mid-line): at most 6 words and 32 tokens
        (text without spaces is one long word), so that samples continue text like the corpus's; chat data, and
        text without shards, get a greeting."""
        if asked is not None:
            return asked
        ds = self.dataset
        if ds is None or self.tokenizer is None or self.format != "text":
            return ["Hello!"]
        tok = self.tokenizer
        for split in ("train", "val"):
            for source in ds.sources:
                for shard in ds.shards(split, source.index):
                    ids = [int(t) for t in shard[:512]]
                    while ids and ids[0] == ds.eos_id:
                        ids.pop(0)
                    ids = ids[: ids.index(ds.eos_id)] if ds.eos_id in ids else ids
                    text = tok.decode(ids, skip_special_tokens=True)  # no BOS spelled out as text
                    line = next((ln for ln in text.splitlines() if ln.strip()), "")
                    words = " ".join(line.split()[:6])
                    # a cut inside a character decodes to U+FFFD: dropped
                    prompt = tok.decode(tok.encode(words)[:32]).rstrip("\ufffd").strip()
                    if prompt:
                        return [prompt]
        return ["Hello!"]


def resolve_sources(sources: list[str]) -> list[str]:
    if not sources:
        raise ConfigError(
            "no training data: pass --data PATH (a file, folder, .jsonl, .parquet or saved HF dataset; "
            "--data @stdlib trains on the Python standard library)"
        )
    return [str(stdlib_path()) if s == STDLIB_ALIAS else s for s in sources]


def loader_phases(cfg: Config) -> list | None:
    """``data.phases`` as the loader's :class:`~gptoughts.data.loader.Phase` list (None without a curriculum)."""
    if not cfg.data.phases:
        return None
    from gptoughts.data.loader import Phase

    out = []
    for p in cfg.data.phases:
        srcs = resolve_sources(p.sources)  # each in data.sources (corpus.check_phases, before the data step)
        # Bare sources are weighted by their token counts; explicit weights are used as given.
        out.append(
            Phase(name=p.name, sources=list(zip(srcs, p.weights)) if p.weights else srcs, tokens=p.tokens)
        )
    return out


def check_phases(cfg: Config) -> None:
    """Every source of ``data.phases`` is one of ``data.sources``: said before the corpus is tokenized (and by a dry
    run), not once the whole corpus is prepared."""
    known = resolve_sources(cfg.data.sources)
    for p in cfg.data.phases:
        for s in resolve_sources(p.sources):
            if s not in known:
                raise ConfigError(
                    f"data.phases `{p.name}` uses {s}, which is not in data.sources; add it there"
                )


def init_from_dir(cfg: Config, *, weights: bool = True) -> Path | None:
    """``model.init_from`` as a checked HF model folder (None when training from scratch); a hub id is its
    snapshot in the Hugging Face cache, downloaded when online (``weights=False``: config and tokenizer only)."""
    if cfg.model.init_from is None:
        return None
    from gptoughts.models.hf import locate, read_config, require_tokenizer

    p = locate(cfg.model.init_from, weights=weights)
    if (p / "config.toml").exists() or (p / "meta.json").exists() or (p / "checkpoints").is_dir():
        # A new run named with a run was given its export (api._start_from_run): what reaches here is a resume whose
        # run kept no export of its base, which it cannot take now (the run may have trained on since).
        raise UserError(
            f"{p} is a gptoughts run, and {cfg.run.out} kept no export of it in base/ to resume from; start a new "
            f"fine-tune from it instead: gptoughts finetune --model {p} --out NEW"
            if cfg.run.resume
            else f"{p} is a gptoughts run; fine-tune from it with gptoughts finetune --model {p} (it exports the "
            "run into OUT/base)"
        )
    read_config(p)  # a clear error now rather than deep inside the model loading
    require_tokenizer(p)  # (fine-tuning tokenizes with the folder's own: not a --tokenizer spec to fix)
    return p


def prepare_data(cfg: Config, env: Environment, *, dry_run: bool = False) -> Data:
    """Tokenizer and token shards (rank 0 prepares, the others read the cache), or the SFT examples. A dry run
    tokenizes nothing: the shards when cached, else the corpus's size and an estimate of its tokens."""
    from gptoughts.data.loader import check_drawable
    from gptoughts.data.prepare import lookup_cached
    from gptoughts.data.sft import resolve_format

    sources = resolve_sources(cfg.data.sources)
    check_phases(cfg)
    init_from = init_from_dir(cfg, weights=not dry_run)  # a dry run reads no weights
    tok_spec: Any = str(init_from) if init_from is not None else cfg.data.tokenizer  # fine-tuning: its own
    if cfg.train.objective == "dpo":
        return _pref_data(cfg, sources, tok_spec, init_from)
    _refuse_pairs_without_dpo(sources)
    if resolve_format(cfg.data.format, sources) == "sft":
        return _sft_data(cfg, sources, tok_spec, init_from)
    tokenizer: Any = tok_spec
    if init_from is not None and cfg.model.trust_remote_code:
        from gptoughts.data.tokenizer import build_tokenizer

        # the base's own tokenizer class may need its code to load (no tokenizer.json), as the user allowed; the
        # cache key is the tokenizer's fingerprint either way
        tokenizer = build_tokenizer(tok_spec, trust_remote_code=True)
    kwargs = dict(
        text_field=cfg.data.text_field,
        extensions=cfg.data.extensions or None,
        val_fraction=cfg.data.val_fraction,
        max_bytes=cfg.data.max_bytes,
        seed=cfg.train.seed,
        cache_root=cfg.data.cache_dir,
    )
    corpus = corpus_size(sources, cfg.data.extensions or None)
    if dry_run:
        manifest = lookup_cached(sources, tokenizer, **kwargs)
        if manifest is None:
            return _estimated(cfg, sources, tok_spec, init_from, corpus)
    else:
        manifest = _prepared(cfg, env, sources, tokenizer, kwargs)
    # what its loader would refuse, said before the run writes anything
    check_drawable(manifest.dir, loader_phases(cfg), cfg.train.block_size)
    corpus.update(
        bytes_read=sum(s.bytes for s in manifest.sources),
        tokens=manifest.train_tokens,
        val_tokens=manifest.val_tokens,
        docs=manifest.totals["docs"],
        vocab=manifest.vocab_size,
        cut=any(s.truncated for s in manifest.sources),
    )
    return Data(
        sources=sources,
        format="text",
        tokenizer=manifest.tokenizer(),
        manifest=manifest,
        init_from=init_from,
        corpus=corpus,
    )


def _sft_data(cfg: Config, sources: list[str], tok_spec: Any, init_from: Path | None) -> Data:
    """Every rank tokenizes the (small) SFT set itself: deterministic, no cache."""
    from gptoughts.data.sft import SFTData

    tokenizer = _sft_tokenizer(tok_spec, sources, cfg.model.trust_remote_code)
    sft = SFTData(
        sources,
        tokenizer,
        block_size=cfg.train.block_size,
        truncation=cfg.data.truncation,
        val_fraction=cfg.data.val_fraction,
        seed=cfg.train.seed,
    )
    corpus = {"examples": sft.stats["examples"], "val_examples": sft.stats["val"], "summary": sft.summary()}
    return Data(
        sources=sources, format="sft", tokenizer=tokenizer, sft=sft, init_from=init_from, corpus=corpus
    )


def _pref_data(cfg: Config, sources: list[str], tok_spec: Any, init_from: Path | None) -> Data:
    """Every line of the preference files read and checked (before any model loads), then tokenized."""
    from gptoughts.data.prefs import PrefData
    from gptoughts.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(tok_spec, trust_remote_code=cfg.model.trust_remote_code)
    pairs = PrefData(
        sources,
        tokenizer,
        block_size=cfg.train.block_size,
        truncation=cfg.data.truncation,
        val_fraction=cfg.data.val_fraction,
        seed=cfg.train.seed,
    )
    corpus = {"examples": pairs.stats["pairs"], "val_pairs": pairs.stats["val"], "summary": pairs.summary()}
    return Data(
        sources=sources, format="prefs", tokenizer=tokenizer, prefs=pairs, init_from=init_from, corpus=corpus
    )


def _refuse_pairs_without_dpo(sources: list[str]) -> None:
    from gptoughts.data.prefs import looks_like_prefs

    if looks_like_prefs(sources):
        raise ConfigError(
            f"{sources[0]} holds preference pairs (chosen/rejected); train on them with --objective dpo"
        )


def _estimated(
    cfg: Config, sources: list[str], tok_spec: Any, init_from: Path | None, corpus: dict[str, Any]
) -> Data:
    """A dry run's corpus with no cached shards: its tokens estimated from its bytes, nothing tokenized."""
    from gptoughts.data.cache import held_out_docs
    from gptoughts.data.split import SplitRule
    from gptoughts.data.tokenizer import parse_spec, tokenizer_before_training

    kind = parse_spec(tok_spec)[0]
    tokenizer, vocab = tokenizer_before_training(tok_spec, trust_remote_code=cfg.model.trust_remote_code)
    cap = cfg.data.max_bytes
    exts = cfg.data.extensions or None
    _refuse_what_the_run_refuses(cfg, sources, exts, tokenizer)
    text = _text_per_source(sources, exts, cfg.data.text_field)  # a Parquet file holds more than its size
    read = sum(text) if cap is None else sum(min(b, cap) for b in text)
    per_token = _bytes_per_token(kind, vocab)
    # a model's own tokenizer: measured on the corpus's start
    if tokenizer is not None and kind not in ("bytes", "bpe"):
        per_token = _measured_bytes_per_token(tokenizer, sources, cfg) or per_token
    # the held-out share the split will take (a small corpus's is larger than data.val_fraction)
    held_out = SplitRule(cfg.data.val_fraction, held_out_docs(cfg.data.val_fraction, None)).share(read)
    corpus.update(
        bytes_read=read,
        vocab=vocab,
        tokens=int(read * (1 - held_out) / per_token),
        val_tokens=int(read * held_out / per_token),
        cut=read < sum(text),
    )
    return Data(
        sources=sources,
        format="text",
        tokenizer=tokenizer,
        init_from=init_from,
        estimated=True,
        corpus=corpus,
    )


def _prepared(
    cfg: Config, env: Environment, sources: list[str], tok_spec: Any, kwargs: dict[str, Any]
) -> Any:
    """The token shards' manifest: rank 0 prepares them (or finds them cached), then the others read the cache."""
    from gptoughts.data.prepare import cached_prepare

    manifest = None

    def prepare() -> None:
        nonlocal manifest
        manifest = cached_prepare(
            sources, tok_spec, progress=cfg.run.progress, workers=cfg.data.workers, **kwargs
        )

    pdist.on_main(prepare, env.dist)  # a refusal there (a bad record found) stops every rank, said once
    if not env.dist.is_main:  # rank 0 checked every shard's checksum just now: sizes are enough here
        manifest = cached_prepare(sources, tok_spec, progress=False, verify=False, **kwargs)
    return manifest


# Bytes of text per token of a byte-level BPE trained on the corpus, measured on the Python standard library
# (30 MB of code): bpe:8192 3.2, bpe:32768 3.9 (what a dry run assumes before the corpus is tokenized).
def _bytes_per_token(kind: str, vocab: int | None) -> float:
    if kind == "bytes":
        return 1.0
    if vocab is None or vocab >= 32768:
        return 3.9
    return 3.2 if vocab >= 8192 else 2.5


def _measured_bytes_per_token(
    tokenizer: Any, sources: list[str], cfg: Config, sample: int = 1 << 18
) -> float | None:
    """Bytes of text per token of ``tokenizer`` on the sources' first ``sample`` bytes: a model's tokenizer is there
    before anything is prepared (the byte-level guesses above erred 2.4x on a fine-tune's small-vocabulary model)."""
    from gptoughts.data.sources import iter_documents

    texts, size = [], 0
    for source in sources:
        docs = iter_documents(source, text_field=cfg.data.text_field, extensions=cfg.data.extensions or None)
        for doc in docs:
            texts.append(doc[: sample - size])
            size += len(texts[-1].encode("utf-8", "replace"))
            if size >= sample:
                break
        docs.close()
        if size >= sample:
            break
    tokens = sum(len(ids) for ids in tokenizer.encode_batch(texts)) if texts else 0
    return size / tokens if tokens else None


def corpus_size(sources: list[str], extensions: list[str] | None) -> dict[str, Any]:
    """Files and bytes on disk of what the sources' reading opens (a walk of file sizes: no reading)."""
    from gptoughts.data.sources import files_read, normalize_extensions, resolve_source

    exts = normalize_extensions(extensions)
    files, per_source = 0, []
    for s in sources:
        sizes = [f.stat().st_size for f in files_read(resolve_source(s), exts)]
        files += len(sizes)
        per_source.append(sum(sizes))
    return {"files": files, "bytes": sum(per_source), "per_source": per_source}


def _text_per_source(sources: list[str], extensions: list[str] | None, text_field: str) -> list[int]:
    """About how many bytes of text each source holds (a dry run's token estimate): its files' sizes, a Parquet
    file's text column uncompressed (read from its footer)."""
    from gptoughts.data.sources import files_read, normalize_extensions, resolve_source, text_bytes_estimate

    exts = normalize_extensions(extensions)
    return [
        sum(text_bytes_estimate(f, text_field) for f in files_read(resolve_source(s), exts)) for s in sources
    ]


def _refuse_what_the_run_refuses(
    cfg: Config, sources: list[str], extensions: list[str] | None, tokenizer: Any
) -> None:
    """An empty source, a corpus of fewer training tokens than one block, or a curriculum phase (the whole corpus
    without one) whose sources are each shorter than a block, refused by a dry run in the run's words (it planned
    256 epochs over 0 tokens, then 15 epochs over 17; a phase of short sources crashed the run's first batch)."""
    from gptoughts.data.loader import fewer_than_a_block, no_block

    block = cfg.train.block_size
    most = _most_tokens(cfg, sources, extensions, tokenizer)
    if sum(most) <= block:
        raise fewer_than_a_block(sum(most), "train", block, at_most=True)
    given = cfg.data.phases or [SimpleNamespace(name=None, sources=cfg.data.sources, weights=None)]
    for phase in given:
        ids = [sources.index(s) for s in resolve_sources(phase.sources)]  # (check_phases: each is a source)
        if not phase.weights and all(most[i] <= block for i in ids):
            raise no_block(phase.name, block, [(cfg.data.sources[i], most[i]) for i in ids], at_most=True)
        # a source weighted in is drawn: shorter than a block, the run refuses it
        short = [i for i, w in zip(ids, phase.weights or []) if w > 0 and most[i] <= block]
        if short:
            raise fewer_than_a_block(most[short[0]], "train", block, cfg.data.sources[short[0]], at_most=True)


def _most_tokens(cfg: Config, sources: list[str], extensions: list[str] | None, tokenizer: Any) -> list[int]:
    """Of each source, at least as many tokens as the run's training split holds, or more than one block: the
    documents the run reads (each source's first, then on while it may hold less than one block), each bounded
    from above so that a corpus that trains is never refused: its end-of-text (and a model's BOS), plus one token
    a byte for ``bytes`` and a BPE of bytes (a merge only joins bytes); with a model's own tokenizer, the more of
    its tokens and its bytes plus one (the split may cut a document, and its head can take more tokens than the
    whole: each token spells a byte or more, beside a leading space marker)."""
    from gptoughts.data.sources import normalize_extensions, resolve_source
    from gptoughts.data.split import Reader

    settings = {"text_field": cfg.data.text_field, "seed": cfg.train.seed, "max_bytes": cfg.data.max_bytes}
    reader = Reader([resolve_source(s) for s in sources], settings, normalize_extensions(extensions))
    own = tokenizer is not None and not tokenizer.is_bytes
    specials = 1 + int(own and tokenizer.bos_id is not None and tokenizer.bos_id != tokenizer.eos_id)
    most = [0] * len(sources)
    for i in range(len(sources)):
        docs = reader.docs(i)  # (a source with no document is refused here, as the run's reading refuses it)
        try:
            for doc in docs:
                size = len(doc.encode("utf-8", "surrogatepass"))
                most[i] += specials + (max(len(tokenizer.encode(doc)), size + 1) if own else size)
                if most[i] > cfg.train.block_size:
                    break
        finally:
            docs.close()
    return most


def _sft_tokenizer(spec: str, sources: list[str], trust_remote_code: bool = False) -> Any:
    """The tokenizer of an SFT run: a folder's or ``bytes`` as is; ``bpe:N`` trained on the conversations."""
    from gptoughts.data.sft import read_conversations
    from gptoughts.data.tokenizer import build_tokenizer

    return build_tokenizer(
        spec,
        texts=lambda: (m["content"] for c in read_conversations(sources) for m in c),
        trust_remote_code=trust_remote_code,
    )


def synthetic_data(vocab_size: int, init_from: Path | None = None, tokenizer: Any = None) -> Data:
    """Stand-in data for timing runs (random tokens): the vocabulary the model is built for, no corpus."""
    return Data(
        sources=[],
        format="text",
        tokenizer=tokenizer,
        init_from=init_from,
        corpus={"vocab": vocab_size, "tokens": 1 << 40, "files": 0, "bytes": 0, "bytes_read": 0},
    )
