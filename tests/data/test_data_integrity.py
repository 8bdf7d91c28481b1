"""Damaged, forged or foreign prepared folders: one-line DataErrors or a rebuild, never a traceback."""

from __future__ import annotations

import importlib
import json
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gptoughts.data import BatchLoader, Manifest, TokenDataset, cached_prepare, eval_batches, prepare
from gptoughts.data.tokenizer import Tokenizer
from gptoughts.errors import DataError

# The module itself: gptoughts.data exports a function of the same name.
prepare_module = importlib.import_module("gptoughts.data.prepare")


def one_line(e: pytest.ExceptionInfo[BaseException]) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def edit_manifest(folder: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    path = folder / "manifest.json"
    data = json.loads(path.read_text())
    result = edit(data)
    path.write_text(json.dumps(data if result is None else result))


def flip_byte(path: Path, offset: int = 10) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


# ------------------------------------------------------------------------------------------ manifest


def _drop_first_source_field(d: dict[str, Any]) -> None:
    del d["sources"][0]["train_shards"]


def _empty_shards(d: dict[str, Any]) -> None:
    d["sources"][0]["train_shards"] = []
    d["sources"][0]["train_checksums"] = []


def _everything_empty(d: dict[str, Any]) -> None:
    for s in d["sources"]:
        for split in ("train", "val"):
            s[f"{split}_shards"], s[f"{split}_checksums"], s[f"{split}_tokens"] = [], [], 0
    d["totals"]["train_tokens"] = d["totals"]["val_tokens"] = 0


def _escaping_shard_name(d: dict[str, Any]) -> None:
    d["sources"][0]["train_shards"] = ["../../etc/passwd"]


def _wrong_dtype(d: dict[str, Any]) -> None:
    d["dtype"] = "uint32"  # vocab 259 is written as uint16


CORRUPT_MANIFESTS: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "empty object": (lambda d: {}, "field format_version"),
    "a list": (lambda d: [1, 2], "not an object"),
    "sources a string": (lambda d: d.update(sources="x"), "field sources"),
    "source without train_shards": (_drop_first_source_field, "field sources[0].train_shards is missing"),
    "no shard for tokens": (_empty_shards, "sources[0].train_shards has 0 file(s)"),
    "no tokens at all": (_everything_empty, "totals.train_tokens is 0"),
    "shard outside the folder": (_escaping_shard_name, "names '../../etc/passwd'"),
    "wrong dtype": (_wrong_dtype, "field dtype"),
    "vocab a string": (lambda d: d.update(vocab_size="259"), "field vocab_size"),
    "bool as int": (lambda d: d.update(eos_id=True), "field eos_id"),
    "unknown field": (lambda d: d.update(extra=1), "unknown field extra"),
    "bad checksum": (lambda d: d["sources"][0].update(train_checksums=["xyz"]), "train_checksums"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT_MANIFESTS))
def test_corrupt_manifest_fields_are_one_line_errors(bytes_dataset: Path, case: str) -> None:
    edit, field = CORRUPT_MANIFESTS[case]
    edit_manifest(bytes_dataset, edit)
    with pytest.raises(DataError) as e:
        Manifest.load(bytes_dataset)
    msg = one_line(e)
    assert msg.startswith(f"{bytes_dataset / 'manifest.json'} is corrupt (") and field in msg, msg
    assert msg.endswith(f"delete {bytes_dataset} and run prepare again")
    with pytest.raises(DataError, match="manifest.json is corrupt"):
        TokenDataset(bytes_dataset)


@pytest.mark.parametrize("content", [b"", b"{", b"\xff\xfe\x00garbage", b"[" * 100_000])
def test_unparsable_manifest_is_a_one_line_error(bytes_dataset: Path, content: bytes) -> None:
    (bytes_dataset / "manifest.json").write_bytes(content)
    with pytest.raises(DataError) as e:
        Manifest.load(bytes_dataset)
    assert "manifest.json is corrupt" in one_line(e)


def test_old_format_is_named(bytes_dataset: Path) -> None:
    edit_manifest(bytes_dataset, lambda d: d.update(format_version=1))
    with pytest.raises(DataError, match="prepared in format 1, this version reads 2; delete it"):
        Manifest.load(bytes_dataset)


def test_cached_prepare_rebuilds_a_corrupt_manifest(tmp_path: Path, corpus: Path) -> None:
    root = tmp_path / "cache"
    first = cached_prepare([corpus], "bytes", cache_root=root, progress=False)
    (first.dir / "manifest.json").write_text('{"sources": "x"}')
    again = cached_prepare([corpus], "bytes", cache_root=root, progress=False)
    assert again.dir == first.dir and Manifest.load(again.dir).to_dict() == again.to_dict()
    (first.dir / "manifest.json").write_bytes(b"\x00\x01 not json")
    assert (
        cached_prepare([corpus], "bytes", cache_root=root, progress=False).train_tokens == first.train_tokens
    )


def test_cached_prepare_rebuilds_a_corrupt_tokenizer(tmp_path: Path, corpus: Path) -> None:
    root = tmp_path / "cache"
    first = cached_prepare([corpus], "bpe:300", cache_root=root, progress=False)
    tok_json = first.dir / "tokenizer" / "tokenizer.json"
    good = tok_json.read_bytes()
    tok_json.write_text('{"truncated": ')
    with pytest.raises(DataError) as e:
        first.tokenizer()
    msg = one_line(e)
    assert msg.startswith(f"{tok_json} is not a valid tokenizer file (") and msg.endswith(
        f"delete {first.dir} and run prepare again"
    )
    again = cached_prepare([corpus], "bpe:300", cache_root=root, progress=False)
    assert tok_json.read_bytes() == good and again.tokenizer().fingerprint() == first.tokenizer_fingerprint
    # A damaged tokenizer_config.json (roles) is caught by its checksum too.
    (first.dir / "tokenizer" / "tokenizer_config.json").write_text("{}")
    cached_prepare([corpus], "bpe:300", cache_root=root, progress=False)
    assert again.tokenizer().mask_id == 2


def test_corrupt_tokenizer_json_anywhere_is_a_data_error(tmp_path: Path) -> None:
    folder = tmp_path / "tk"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("not json at all")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(DataError) as e:
        Tokenizer.load(folder)
    assert one_line(e).startswith(f"{folder / 'tokenizer.json'} is not a valid tokenizer file")


def test_tokenizer_that_does_not_match_the_manifest(bytes_dataset: Path) -> None:
    edit_manifest(bytes_dataset, lambda d: d.update(vocab_size=300))
    with pytest.raises(DataError, match="has vocab size 259 and eos id 0, but .* says 300 and 0"):
        Manifest.load(bytes_dataset).tokenizer()


def test_prepare_refuses_a_folder_whose_manifest_is_not_ours(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "site"
    out.mkdir()
    (out / "manifest.json").write_text('{"name": "my web app", "icons": []}')
    with pytest.raises(DataError) as e:
        prepare([corpus], out, "bytes", progress=False)
    assert "not a prepared dataset (no manifest.json written by gptoughts)" in one_line(e)
    assert json.loads((out / "manifest.json").read_text())["name"] == "my web app"


def test_prepare_rebuilds_its_own_damaged_manifest(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "o"
    m = prepare([corpus], out, "bytes", progress=False)
    edit_manifest(out, lambda d: d.update(sources="x"))  # still recognisably ours: cache_key, format_version
    assert prepare([corpus], out, "bytes", progress=False).train_tokens == m.train_tokens
    assert Manifest.load(out).train_tokens == m.train_tokens


# ------------------------------------------------------------------------------------------ checksums


def test_manifest_records_the_crc32_of_every_shard(tmp_path: Path, corpus: Path, monkeypatch) -> None:
    monkeypatch.setattr(prepare_module, "SHARD_TOKENS", 1000)  # several shards per split
    out = tmp_path / "o"
    m = prepare([corpus], out, "bytes", progress=False, val_fraction=0.2)
    src = m.sources[0]
    assert len(src.train_shards) > 3 and m.shard_tokens == 1000 and m.checksum == "crc32"
    for split in ("train", "val"):
        for name, crc in zip(getattr(src, f"{split}_shards"), getattr(src, f"{split}_checksums")):
            assert crc == f"{zlib.crc32((out / name).read_bytes()):08x}"
    assert set(m.tokenizer_files) >= {"tokenizer.json", "tokenizer_config.json"}
    m.verify()
    ds = TokenDataset(out)
    assert ds.num_tokens("train") == m.train_tokens
    flip_byte(out / src.train_shards[2])
    with pytest.raises(DataError) as e:
        m.verify()
    assert one_line(e).startswith(f"{out / src.train_shards[2]} does not match its checksum")


def test_cached_prepare_rebuilds_a_shard_with_a_flipped_byte(tmp_path: Path, corpus: Path) -> None:
    root = tmp_path / "cache"
    first = cached_prepare([corpus], "bytes", cache_root=root, progress=False)
    shard = first.dir / first.sources[0].train_shards[0]
    good = shard.read_bytes()
    flip_byte(shard)
    # Without verification the damaged folder is reused as it is (sizes still match)...
    assert (
        cached_prepare([corpus], "bytes", cache_root=root, progress=False, verify=False).created
        == first.created
    )
    assert shard.read_bytes() != good
    # ...with it (the default), it is rebuilt.
    cached_prepare([corpus], "bytes", cache_root=root, progress=False)
    assert shard.read_bytes() == good


def test_token_dataset_checks_sizes_but_not_checksums(bytes_dataset: Path) -> None:
    m = Manifest.load(bytes_dataset)
    shard = bytes_dataset / m.sources[0].train_shards[0]
    flip_byte(shard)
    TokenDataset(bytes_dataset)  # documented: no content check on load (Manifest.verify does it)
    with pytest.raises(DataError, match="does not match its checksum"):
        m.verify()
    shard.write_bytes(shard.read_bytes()[:-3])  # truncated, and not a multiple of the token size
    with pytest.raises(DataError) as e:
        TokenDataset(bytes_dataset)
    assert one_line(e).startswith(f"{shard} has {2 * m.sources[0].train_tokens - 3} bytes where")
    shard.unlink()
    with pytest.raises(DataError, match=f"{shard} is missing; delete {bytes_dataset} and run prepare again"):
        TokenDataset(bytes_dataset)


# ------------------------------------------------------------------------------------------ ids >= vocab


def _forge_id(path: Path, position: int, value: int) -> None:
    ids = np.fromfile(path, dtype=np.uint16)
    ids[position] = value
    ids.tofile(path)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_an_id_outside_the_vocab_stops_the_loader(bytes_dataset: Path, prefetch: int) -> None:
    shard = bytes_dataset / "train_0_0.bin"
    n = np.fromfile(shard, dtype=np.uint16).size
    _forge_id(shard, n - 1, 300)  # the very last token: only ever seen as a target (y)
    _forge_id(shard, n // 2, 65535)
    with BatchLoader(bytes_dataset, batch_size=8, block_size=16, prefetch=prefetch) as loader:
        with pytest.raises(DataError) as e:
            for _ in range(200):  # an epoch is ~65 batches: every window is visited
                next(loader)
    msg = one_line(e)
    assert msg.startswith(f"{shard} holds token id ") and "outside the vocabulary of 259" in msg
    assert f"delete the prepared folder {bytes_dataset} and prepare again" in msg


def test_an_id_outside_the_vocab_only_as_a_target_is_caught(bytes_dataset: Path) -> None:
    shard = bytes_dataset / "train_0_0.bin"
    n = np.fromfile(shard, dtype=np.uint16).size
    T = 16
    last_window_end = ((n - 1) // T) * T  # y of the last window ends here: never an input
    _forge_id(shard, last_window_end, 259)
    with BatchLoader(bytes_dataset, batch_size=1, block_size=T, prefetch=0) as loader:
        with pytest.raises(DataError, match="holds token id 259"):
            for _ in range(loader.windows_per_epoch):
                next(loader)


def test_eval_batches_check_ids(bytes_dataset: Path) -> None:
    shard = bytes_dataset / "val_0_0.bin"
    _forge_id(shard, 5, 1000)
    with pytest.raises(DataError) as e:
        list(eval_batches(bytes_dataset, batch_size=2, block_size=8, max_batches=None))
    assert one_line(e).startswith(f"{shard} holds token id 1000")
