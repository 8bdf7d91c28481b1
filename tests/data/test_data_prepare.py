from __future__ import annotations

import json
import logging
import re
import sysconfig
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from gptoughts.data import BatchLoader, Manifest, TokenDataset, cached_prepare, prepare, token_dtype
from gptoughts.data.manifest import FORMAT_VERSION
from gptoughts.data.tokenizer import bytes_tokenizer
from gptoughts.errors import DataError


def split_docs(out: Path, m: Manifest, split: str) -> list[str]:
    """Decode a split's shards back into documents (they are eos-terminated)."""
    tok = m.tokenizer()
    docs = []
    for s in m.sources:
        ids = np.concatenate(
            [np.fromfile(out / f, dtype=m.dtype) for f in getattr(s, f"{split}_shards")] or [[]]
        )
        bounds = np.flatnonzero(ids == m.eos_id)
        start = 0
        for b in bounds:
            docs.append(tok.decode(ids[start:b].tolist()))
            start = b + 1
        assert start == ids.size, "every document ends with eos"
    return docs


def markers(docs: list[str]) -> set[str]:
    return {re.match(r"<doc-\d+>", d).group(0) for d in docs}  # type: ignore[union-attr]


def test_prepare_writes_shards_manifest_and_tokenizer(
    tmp_path: Path, corpus: Path, make_docs: Callable[..., list[str]]
) -> None:
    out = tmp_path / "out"
    m = prepare([corpus], out, "bytes", progress=False, val_fraction=0.1)
    assert (out / "manifest.json").is_file() and (out / "tokenizer" / "tokenizer.json").is_file()
    assert m.dtype == "uint16" and m.vocab_size == 259 and m.eos_id == 0 and m.bos_id is None
    assert m.tokenizer_spec == "bytes" and m.tokenizer_fingerprint == bytes_tokenizer().fingerprint()
    src = m.sources[0]
    assert src.kind == "folder" and src.hash_method == "stat" and src.docs == 40 and not src.truncated
    assert src.train_docs + src.val_docs == 40 and src.val_docs >= 1
    assert src.train_shards == ["train_0_0.bin"] and src.val_shards == ["val_0_0.bin"]
    assert (out / "train_0_0.bin").stat().st_size == 2 * src.train_tokens
    raw = sum(len(d.encode()) for d in make_docs(40))
    assert m.train_tokens + m.val_tokens == raw + 40  # one byte token per byte, one eos per document
    assert m.totals["docs"] == 40 and m.stats["skipped_binary"] == 0
    again = Manifest.load(out)
    assert again.to_dict() == m.to_dict()
    assert json.loads((out / "manifest.json").read_text())["format_version"] == FORMAT_VERSION == 2


def test_val_documents_are_disjoint_from_train(
    tmp_path: Path, corpus: Path, make_docs: Callable[..., list[str]]
) -> None:
    out = tmp_path / "out"
    m = prepare([corpus], out, "bytes", progress=False, val_fraction=0.2, seed=3)
    train, val = split_docs(out, m, "train"), split_docs(out, m, "val")
    assert len(train) + len(val) == 40 and val
    assert markers(train).isdisjoint(markers(val))
    assert sorted(train + val) == sorted(make_docs(40))
    assert markers(val) == {f"<doc-{k}>" for k in m.sources[0].val_doc_indices}
    other = prepare([corpus], tmp_path / "out2", "bytes", progress=False, val_fraction=0.2, seed=4)
    assert other.sources[0].val_doc_indices != m.sources[0].val_doc_indices  # the seed draws the split


def test_min_val_docs(tmp_path: Path, corpus: Path) -> None:
    m = prepare([corpus], tmp_path / "o", "bytes", progress=False, val_fraction=0.0, min_val_docs=3)
    assert m.sources[0].val_docs == 3 and m.val_split == "documents"


def test_single_document_val_is_its_tail(tmp_path: Path) -> None:
    # 2.6 KB: under the floor of ~1 KiB of val text, so 10% of it (the small-corpus cap) is held out.
    text = "".join(f"line {i}\n" for i in range(300))
    (tmp_path / "one.txt").write_text(text)
    out = tmp_path / "o"
    m = prepare([tmp_path / "one.txt"], out, "bytes", progress=False)
    assert "the last 10.00% of each of the 1 document(s)" in m.val_split
    head, tail = split_docs(out, m, "train"), split_docs(out, m, "val")
    assert len(head) == 1 and len(tail) == 1 and head[0] + tail[0] == text
    assert tail[0].startswith("line ") and 0.05 < len(tail[0]) / len(text) < 0.2
    src = m.sources[0]
    assert src.hash_method == "content" and src.val_tail_doc_indices == [0] and src.val_docs == 0


def test_bpe_tokenizer_trained_and_saved(
    tmp_path: Path, corpus: Path, make_docs: Callable[..., list[str]]
) -> None:
    out = tmp_path / "o"
    m = prepare([corpus], out, "bpe:300", progress=False)
    tok = m.tokenizer()
    assert m.tokenizer_spec == "bpe:300" and tok.fingerprint() == m.tokenizer_fingerprint
    assert 259 < m.vocab_size <= 300
    assert sorted(split_docs(out, m, "train") + split_docs(out, m, "val")) == sorted(make_docs(40))


def _big_vocab_folder(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "[UNK]": 1} | {f"w{i}": i + 2 for i in range(70_000)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "bigvocab"
    folder.mkdir()
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder


def test_dtype_follows_vocab_size(tmp_path: Path, write_folder: Callable[..., Path]) -> None:
    assert (
        token_dtype(259) == np.uint16 and token_dtype(65535) == np.uint16 and token_dtype(65536) == np.uint32
    )
    write_folder(tmp_path / "c", ["w1 w69999 w5", "w42 w65536", "w7 w8 w9"])
    out = tmp_path / "o"
    m = prepare([tmp_path / "c"], out, str(_big_vocab_folder(tmp_path)), progress=False, val_fraction=0.0)
    assert m.dtype == "uint32" and m.vocab_size == 70_002
    ids = np.concatenate([np.fromfile(out / f, dtype=np.uint32) for s in m.sources for f in s.train_shards])
    assert 70_001 in ids.tolist() and 65_538 in ids.tolist()


def _bos_tokenizer(folder: Path) -> Path:
    """A bytes tokenizer with ``<s>`` as BOS and ``</s>`` as EOS, saved in ``folder``."""
    base = bytes_tokenizer()
    base.backend.add_special_tokens(["<s>", "</s>"])
    folder.mkdir()
    base.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


def test_bos_is_written_before_each_document(tmp_path: Path, write_folder: Callable[..., Path]) -> None:
    folder = _bos_tokenizer(tmp_path / "tk")
    write_folder(tmp_path / "c", ["ab", "cd", "ef"])
    out = tmp_path / "o"
    m = prepare([tmp_path / "c"], out, str(folder), progress=False, val_fraction=0.0, min_val_docs=0)
    ids = np.fromfile(out / "train_0_0.bin", dtype=np.uint16).tolist()
    assert m.bos_id == 259 and m.eos_id == 260
    assert ids == [259, 3 + 97, 3 + 98, 260, 259, 3 + 99, 3 + 100, 260, 259, 3 + 101, 3 + 102, 260]


def test_the_default_sample_prompt_has_no_special_token(
    tmp_path: Path, write_folder: Callable[..., Path]
) -> None:
    # The prompt taken from the corpus (eval.sample_prompts unset) is plain text: a BOS written before each
    # document is not spelled out as "<s>", which the sampler would encode as three ordinary characters.
    from gptoughts.data.tokenizer import Tokenizer
    from gptoughts.training.corpus import Data

    folder = _bos_tokenizer(tmp_path / "tk")
    write_folder(tmp_path / "c", ["The quick brown fox jumps over the lazy dog.", "Another document."])
    m = prepare(
        [tmp_path / "c"], tmp_path / "o", str(folder), progress=False, val_fraction=0.0, min_val_docs=0
    )
    assert m.bos_id is not None
    data = Data(sources=[str(tmp_path / "c")], format="text", tokenizer=Tokenizer.load(folder), manifest=m)
    assert data.sample_prompts(None) == ["The quick brown fox jumps over"]
    assert data.sample_prompts(["x"]) == ["x"] and data.sample_prompts([]) == []


def test_cache_reuse_and_invalidation(tmp_path: Path, corpus: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "o"
    m1 = prepare([corpus], out, "bytes", progress=False)
    shard = out / m1.sources[0].train_shards[0]
    mtime = shard.stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="gptoughts.data"):
        m2 = prepare([corpus], out, "bytes", progress=False)
    assert "reusing cached shards" in caplog.text
    assert m2.created == m1.created and m2.cache_key == m1.cache_key and shard.stat().st_mtime_ns == mtime
    # Another setting: another key (replacing a dataset of other settings takes overwrite).
    m3 = prepare([corpus], out, "bytes", progress=False, seed=1, overwrite=True)
    assert m3.cache_key != m1.cache_key
    # A source edit invalidates the cache.
    (corpus / "doc_0000.txt").write_text("<doc-0> a different and longer first document\n")
    m4 = prepare([corpus], out, "bytes", progress=False, seed=1)
    assert m4.cache_key != m3.cache_key
    assert m4.train_tokens + m4.val_tokens != m3.train_tokens + m3.val_tokens
    assert not list(tmp_path.glob(".o.tmp-*")) and not list(tmp_path.glob(".o.old-*"))


def test_cached_prepare_picks_a_folder_per_key(tmp_path: Path, corpus: Path) -> None:
    root = tmp_path / "cache"
    a = cached_prepare([corpus], "bytes", cache_root=root, progress=False)
    b = cached_prepare([corpus], "bytes", cache_root=root, progress=False)
    c = cached_prepare([corpus], "bytes", cache_root=root, progress=False, val_fraction=0.3)
    assert a.dir == b.dir and a.created == b.created and a.dir.parent == root
    assert c.dir != a.dir and a.dir.name.startswith("corpus-bytes-")


def test_cache_rebuilds_when_a_shard_is_damaged(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "o"
    m1 = prepare([corpus], out, "bytes", progress=False)
    (out / m1.sources[0].train_shards[0]).write_bytes(b"\0\0")
    m2 = prepare([corpus], out, "bytes", progress=False)
    assert (out / m2.sources[0].train_shards[0]).stat().st_size == 2 * m2.sources[0].train_tokens


def test_max_bytes_caps_each_source(tmp_path: Path, corpus: Path) -> None:
    m = prepare([corpus], tmp_path / "o", "bytes", progress=False, max_bytes=1000)
    src = m.sources[0]
    # at most the cap: the fifth document (~200 bytes) is cut where it crosses it, at a line end if near
    assert src.truncated and 1000 - 150 < src.bytes <= 1000 and src.docs == 5


def test_multiple_sources_of_several_kinds(
    tmp_path: Path, corpus: Path, make_docs: Callable[..., list[str]]
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    jl = tmp_path / "d.jsonl"
    jl.write_text("".join(json.dumps({"text": d}) + "\n" for d in make_docs(10, seed=1)))
    pqf = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": make_docs(10, seed=2)}), pqf)
    out = tmp_path / "o"
    m = prepare([corpus, jl, pqf], out, "bytes", progress=False)
    assert [s.kind for s in m.sources] == ["folder", "jsonl", "parquet"]
    assert [s.docs for s in m.sources] == [40, 10, 10]
    assert m.sources[2].train_shards == ["train_2_0.bin"]
    ds = TokenDataset(out)
    assert ds.num_tokens("train", 1) == m.sources[1].train_tokens


def test_empty_corpus_and_missing_path(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    (empty / "b.txt").write_text("  \n")
    with pytest.raises(DataError, match="no text"):
        prepare([empty], tmp_path / "o", "bytes", progress=False)
    with pytest.raises(DataError, match="does not exist"):
        prepare([tmp_path / "nope"], tmp_path / "o", "bytes", progress=False)
    assert not (tmp_path / "o").exists()


def test_failed_build_leaves_nothing(tmp_path: Path) -> None:
    jl = tmp_path / "d.jsonl"
    jl.write_text('{"text": "fine"}\n' * 5 + '{"body": "oops"}\n')
    with pytest.raises(DataError, match=":6 has no field 'text'"):
        prepare([jl], tmp_path / "o", "bytes", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]


def test_refuses_to_replace_a_foreign_folder(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    with pytest.raises(DataError, match="not a prepared dataset"):
        prepare([corpus], out, "bytes", progress=False)
    assert (out / "notes.txt").read_text() == "precious"


def test_stdlib_slice(tmp_path: Path) -> None:
    stdlib = sysconfig.get_paths()["stdlib"]
    out = tmp_path / "o"
    m = prepare([stdlib], out, "bpe:512", progress=False, max_bytes=300_000, val_fraction=0.05)
    src = m.sources[0]
    assert src.truncated and src.docs > 5 and m.stats["skipped_binary"] == 0
    assert src.val_docs + len(src.val_tail_doc_indices) >= 1 and m.val_tokens > 0
    assert 300_000 - 2_000 < src.bytes <= 300_000  # the last file read is cut at a line end near the cap
    assert m.train_tokens < src.bytes  # BPE compresses code
    with BatchLoader(TokenDataset(out), batch_size=2, block_size=64, prefetch=0) as loader:
        x, y = next(loader)
    assert x.shape == (2, 64) and int(x.max()) < m.vocab_size


def test_dataset_prepared_inside_its_own_corpus_is_not_read(tmp_path: Path, corpus: Path) -> None:
    m1 = prepare([corpus], corpus / "prepared", "bytes", progress=False)
    m2 = prepare([corpus], corpus / "prepared", "bytes", progress=False)
    assert m2.created == m1.created and m1.sources[0].docs == 40


# ------------------------------------------------------------------------------------------ split shares


def _text(n_bytes: int, seed: int) -> str:
    """~n_bytes of ASCII lines of random words (lines of ~40 characters)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghij klmnopqrstuvwxyz"))
    chars = rng.choice(letters, n_bytes)
    chars[rng.integers(0, n_bytes, n_bytes // 40)] = "\n"
    return "".join(chars.tolist())


def _val_share(m: Manifest) -> float:
    return m.val_tokens / (m.train_tokens + m.val_tokens)


@pytest.mark.parametrize("megabytes", [0.3, 1.2, 2, 5])
def test_a_single_text_file_holds_out_about_val_fraction(tmp_path: Path, megabytes: float) -> None:
    # A 1.2-2 MB file is read as two ~1 MiB documents: holding one out whole lost 40-70% of the tokens.
    f = tmp_path / "book.txt"
    f.write_text(_text(int(megabytes * 1_000_000), seed=int(megabytes * 10)))
    out = tmp_path / "o"
    m = prepare([f], out, "bytes", progress=False)  # val_fraction 0.005, prepare's default and train's
    assert m.val_tokens > 0 and 0.5 * 0.005 <= _val_share(m) <= 3 * 0.005, _val_share(m)
    src = m.sources[0]
    assert src.val_docs == 0 and len(src.val_tail_doc_indices) == src.docs  # every piece gives its tail
    # Heads and tails are the file's text, cut at line starts.
    train, val = split_docs(out, m, "train"), split_docs(out, m, "val")
    assert "".join(h + t for h, t in zip(train, val)) == f.read_text() and all(t[:1] != "\n" for t in val)


def test_a_folder_of_two_large_files_holds_out_about_val_fraction(tmp_path: Path) -> None:
    folder = tmp_path / "two"
    folder.mkdir()
    for k in range(2):
        (folder / f"part{k}.txt").write_text(_text(1_000_000, seed=k))
    m = prepare([folder], tmp_path / "o", "bytes", progress=False, val_fraction=0.01)
    assert m.val_tokens > 0 and 0.5 * 0.01 <= _val_share(m) <= 3 * 0.01, _val_share(m)
    assert m.sources[0].val_tail_doc_indices == [0, 1] and "last 1.00%" in m.val_split


def test_bpe_on_a_single_file_holds_out_about_val_fraction(tmp_path: Path) -> None:
    f = tmp_path / "book.txt"
    f.write_text(_text(1_200_000, seed=7))
    m = prepare([f], tmp_path / "o", "bpe:400", progress=False)
    assert m.val_tokens > 0 and 0.5 * 0.005 <= _val_share(m) <= 3 * 0.005, _val_share(m)


def test_many_documents_keep_the_document_lottery(tmp_path: Path, write_folder: Callable[..., Path]) -> None:
    # No document is longer than 2 * val_fraction of the corpus: exactly the documents whose hash falls
    # under val_fraction are held out, whole, as before the tail rule.
    from gptoughts.data.split import _doc_u

    docs = [f"<doc-{k}> " + _text(1000, seed=k) for k in range(300)]
    folder = write_folder(tmp_path / "many", docs)
    m = prepare([folder], tmp_path / "o", "bytes", progress=False, val_fraction=0.05)
    src = m.sources[0]
    expected = [k for k, d in enumerate(docs) if _doc_u(0, 0, k, d) < 0.05]
    assert src.val_doc_indices == expected and len(expected) >= 5
    assert src.val_tail_doc_indices == [] and m.val_split == "documents"
    assert markers(split_docs(tmp_path / "o", m, "val")) == {f"<doc-{k}>" for k in expected}


def test_one_long_document_among_short_ones_gives_a_tail(
    tmp_path: Path, write_folder: Callable[..., Path]
) -> None:
    docs = ["<doc-0> " + _text(200_000, seed=1)] + [f"<doc-{k}> " + _text(500, seed=k) for k in range(1, 40)]
    folder = write_folder(tmp_path / "mixed", docs)
    out = tmp_path / "o"
    m = prepare([folder], out, "bytes", progress=False, val_fraction=0.01)
    src = m.sources[0]
    assert src.val_tail_doc_indices == [0] and 0 not in src.val_doc_indices
    assert 0.005 <= _val_share(m) <= 0.03
    train = split_docs(out, m, "train")
    assert train[0].startswith("<doc-0>") and len(train[0]) > 0.98 * len(docs[0])  # the head stays train


def test_unwritable_output_is_a_data_error(tmp_path: Path, corpus: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(DataError, match=f"cannot write {blocker} .*; pass an output folder you can write to"):
        prepare([corpus], blocker / "out", "bytes", progress=False)
    assert blocker.read_text() == "x"


def test_lookup_cached_finds_without_building(tmp_path: Path, corpus: Path) -> None:
    from gptoughts.data.prepare import lookup_cached

    root = tmp_path / "cache"
    assert lookup_cached([corpus], "bytes", cache_root=root, val_fraction=0.1) is None
    assert not root.exists()  # nothing built, not even the root
    m = cached_prepare([corpus], "bytes", cache_root=root, progress=False, val_fraction=0.1)
    found = lookup_cached([corpus], "bytes", cache_root=root, val_fraction=0.1, progress=False)
    assert found is not None and found.dir == m.dir and found.created == m.created
    assert lookup_cached([corpus], "bytes", cache_root=root, val_fraction=0.2) is None
