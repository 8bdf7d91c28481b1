"""Data: sources -> tokenizer -> token shards (prepare) -> batches (loader). See docs/internals.md."""

from __future__ import annotations

from gptoughts.data.cache import cache_key, default_cache_dir
from gptoughts.data.loader import BatchLoader, Phase, TokenDataset, eval_batches
from gptoughts.data.manifest import Manifest, SourceInfo, token_dtype
from gptoughts.data.prepare import cached_prepare, prepare
from gptoughts.data.sources import DEFAULT_EXTENSIONS, SourceStats, iter_documents, source_kind
from gptoughts.data.tokenizer import Tokenizer, build_tokenizer

__all__ = [
    "DEFAULT_EXTENSIONS",
    "BatchLoader",
    "Manifest",
    "Phase",
    "SourceInfo",
    "SourceStats",
    "TokenDataset",
    "Tokenizer",
    "build_tokenizer",
    "cache_key",
    "cached_prepare",
    "default_cache_dir",
    "eval_batches",
    "iter_documents",
    "prepare",
    "source_kind",
    "token_dtype",
]
