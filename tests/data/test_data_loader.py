from __future__ import annotations

import io
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from gptoughts.data import BatchLoader, Phase, TokenDataset, eval_batches, prepare
from gptoughts.errors import ConfigError, DataError


def take(loader: BatchLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [next(loader) for _ in range(n)]


def same(a: list[tuple[torch.Tensor, torch.Tensor]], b: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b)
    )


def train_tokens(ds: TokenDataset, source: int = 0) -> np.ndarray:
    return np.concatenate([np.asarray(a) for a in ds.shards("train", source)]).astype(np.int64)


def test_batches_are_shifted_windows_of_the_shards(bytes_dataset: Path) -> None:
    ds = TokenDataset(bytes_dataset)
    toks = train_tokens(ds)
    T = 16
    with BatchLoader(ds, batch_size=4, block_size=T, prefetch=2) as loader:
        for x, y in take(loader, 5):
            assert x.shape == y.shape == (4, T) and x.dtype == y.dtype == torch.int64
            assert torch.equal(x[:, 1:], y[:, :-1])
            for row_x, row_y in zip(x.numpy(), y.numpy()):
                start = int(
                    np.flatnonzero(np.lib.stride_tricks.sliding_window_view(toks, T).__eq__(row_x).all(1))[0]
                )
                assert start % T == 0  # windows at stride block_size
                assert (toks[start + 1 : start + T + 1] == row_y).all()


def test_an_epoch_visits_every_window_once(bytes_dataset: Path) -> None:
    ds = TokenDataset(bytes_dataset)
    T = 16
    loader = BatchLoader(ds, batch_size=1, block_size=T, prefetch=0)
    n = loader.windows_per_epoch
    assert n == (train_tokens(ds).size - 1) // T
    rows = [tuple(next(loader)[0][0].tolist()) for _ in range(n)]
    assert len(set(rows)) == n and loader.epoch == 1.0
    second = [tuple(next(loader)[0][0].tolist()) for _ in range(n)]
    assert set(second) == set(rows) and second != rows  # a new permutation each epoch


def test_deterministic_from_the_seed(bytes_dataset: Path) -> None:
    def run(seed: int, prefetch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        with BatchLoader(bytes_dataset, batch_size=3, block_size=8, seed=seed, prefetch=prefetch) as loader:
            return take(loader, 6)

    assert same(run(0, 4), run(0, 0))
    assert not same(run(0, 4), run(1, 4))


def test_exact_resume_with_prefetch(bytes_dataset: Path) -> None:
    kw = dict(batch_size=2, block_size=8, seed=5, prefetch=4)
    with BatchLoader(bytes_dataset, **kw) as ref:
        expected = take(ref, 12)
    with BatchLoader(bytes_dataset, **kw) as first:
        assert same(take(first, 5), expected[:5])
        sd = first.state_dict()  # the prefetch thread is several batches ahead by now
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert sd["rows"] == 10 and all(type(v) in (int, str, list) for v in sd.values())
    with BatchLoader(bytes_dataset, **kw) as resumed:
        resumed.load_state_dict(sd)
        assert resumed.tokens_consumed == 10 * 8
        assert same(take(resumed, 7), expected[5:])


def test_load_state_dict_mismatch(bytes_dataset: Path) -> None:
    sd = BatchLoader(bytes_dataset, batch_size=2, block_size=8, prefetch=0).state_dict()
    other = BatchLoader(bytes_dataset, batch_size=2, block_size=16, prefetch=0)
    with pytest.raises(ConfigError, match="block_size=8"):
        other.load_state_dict(sd)


def test_rank_sharding(bytes_dataset: Path) -> None:
    B = 3
    with BatchLoader(bytes_dataset, batch_size=2 * B, block_size=8, seed=2) as single:
        whole = take(single, 4)
    per_rank = []
    for rank in range(2):
        with BatchLoader(
            bytes_dataset, batch_size=B, block_size=8, seed=2, rank=rank, world_size=2
        ) as loader:
            per_rank.append(take(loader, 4))
            assert loader.tokens_consumed == 4 * 2 * B * 8  # global count, the same on every rank
    for step in range(4):
        x0, x1 = per_rank[0][step][0], per_rank[1][step][0]
        assert torch.equal(torch.cat([x0, x1]), whole[step][0])
        rows0, rows1 = {tuple(r) for r in x0.tolist()}, {tuple(r) for r in x1.tolist()}
        assert rows0.isdisjoint(rows1)


def _two_source_dataset(tmp_path: Path, write_folder: Callable[..., Path]) -> Path:
    a = write_folder(tmp_path / "src_a", ["a" * 300 for _ in range(6)])
    b = write_folder(tmp_path / "src_b", ["b" * 300 for _ in range(6)])
    out = tmp_path / "two"
    prepare([a, b], out, "bytes", progress=False)
    return out


A_IDS, B_IDS, EOS = {3 + ord("a"), 0}, {3 + ord("b"), 0}, 0


def _source_of(row: torch.Tensor) -> str:
    ids = set(row.tolist())
    return "a" if ids <= A_IDS else "b" if ids <= B_IDS else "?"


def test_phases_switch_at_the_token_budget(tmp_path: Path, write_folder: Callable[..., Path]) -> None:
    out = _two_source_dataset(tmp_path, write_folder)
    B, T = 4, 16
    phases = [Phase("warmup", [(str(tmp_path / "src_a"), 1.0)], tokens=3 * B * T), Phase("main", ["src_b"])]
    with BatchLoader(out, batch_size=B, block_size=T, phases=phases) as loader:
        assert loader.phase_name == "warmup"
        seen = []
        for _ in range(6):
            x, _y = next(loader)
            seen.append({_source_of(r) for r in x})
        assert seen == [{"a"}] * 3 + [{"b"}] * 3
        assert loader.phase_name == "main"


def test_mixing_weights(tmp_path: Path, write_folder: Callable[..., Path]) -> None:
    out = _two_source_dataset(tmp_path, write_folder)
    with BatchLoader(out, batch_size=50, block_size=8, phases=[Phase("mix", [(0, 3.0), (1, 1.0)])]) as loader:
        rows = [_source_of(r) for _ in range(8) for r in next(loader)[0]]
    share = rows.count("a") / len(rows)
    assert 0.68 < share < 0.82 and "?" not in rows
    with pytest.raises(ConfigError, match="unknown data source 'src_c'"):
        BatchLoader(out, batch_size=2, block_size=8, phases=[Phase("x", ["src_c"])])
    with pytest.raises(ConfigError, match="no token budget but is not the last"):
        BatchLoader(out, batch_size=2, block_size=8, phases=[Phase("x", [0]), Phase("y", [1])])


def test_corpus_smaller_than_a_block(bytes_dataset: Path) -> None:
    n = TokenDataset(bytes_dataset).num_tokens("train")
    with pytest.raises(
        DataError, match=rf"corpus has {n} train tokens, fewer than one block of block_size\+1"
    ):
        BatchLoader(bytes_dataset, batch_size=2, block_size=n)
    BatchLoader(bytes_dataset, batch_size=2, block_size=n - 1, prefetch=0)  # exactly one window fits


def test_eval_batches_are_fixed_and_spread(bytes_dataset: Path) -> None:
    ds = TokenDataset(bytes_dataset)
    first = list(eval_batches(ds, batch_size=2, block_size=8, max_batches=3))
    second = list(eval_batches(ds, batch_size=2, block_size=8, max_batches=3))
    assert len(first) == 3 and same(first, second)
    val = np.concatenate([np.asarray(a) for a in ds.shards("val", 0)]).astype(np.int64)
    starts = [
        int(np.flatnonzero(np.lib.stride_tricks.sliding_window_view(val, 8).__eq__(r).all(1))[0])
        for x, _ in first
        for r in x.numpy()
    ]
    assert starts == sorted(starts) and starts[-1] > val.size // 2  # spread over the whole split
    for x, y in first:
        assert torch.equal(x[:, 1:], y[:, :-1])
    n_val = ds.num_tokens("val")
    with pytest.raises(DataError, match=f"corpus has {n_val} val tokens"):
        list(eval_batches(ds, batch_size=2, block_size=n_val, max_batches=1))
    ranks = [
        list(eval_batches(ds, batch_size=2, block_size=8, max_batches=3, rank=r, world_size=2))
        for r in (0, 1)
    ]
    assert len(ranks[0]) == len(ranks[1]) == 1  # 3 batches rounded down to a multiple of world_size


def test_whole_eval_batches_hold_every_window_once(bytes_dataset: Path) -> None:
    """`gptoughts eval` scores all of a corpus: every window once, the last batch holding what is left (full
    batches only had dropped up to a batch of windows, 14% of a small file)."""
    ds = TokenDataset(bytes_dataset)
    full = list(eval_batches(ds, split="train", batch_size=3, block_size=8, max_batches=None))
    whole = list(eval_batches(ds, split="train", batch_size=3, block_size=8, max_batches=None, whole=True))
    rows = [tuple(r) for x, _ in whole for r in x.tolist()]
    windows = sum(len(s) - 1 for s in ds.shards("train", 0)) // 8
    assert len(rows) == len(set(rows)) == windows and windows % 3  # a remainder the full batches left out
    assert [len(x) for x, _ in whole] == [3] * (windows // 3) + [windows % 3]
    assert sum(len(x) for x, _ in full) == 3 * (windows // 3)


def test_close_and_thread_errors(bytes_dataset: Path) -> None:
    loader = BatchLoader(bytes_dataset, batch_size=2, block_size=8, prefetch=2)
    next(loader)
    thread = loader._thread
    assert thread is not None and thread.is_alive()
    loader.close()
    assert not thread.is_alive()
    next(loader)  # restarts from the consumed state
    loader.close()

    def boom(state: object) -> None:
        raise ValueError("shard vanished")

    broken = BatchLoader(bytes_dataset, batch_size=2, block_size=8, prefetch=2)
    broken._producer.make = boom  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="shard vanished"):
        next(broken)
    assert broken._thread is None
    assert not [t for t in threading.enumerate() if t.name == "gptoughts-batch-prefetch" and t.is_alive()]


def test_garbage_collected_loader_stops_its_thread(bytes_dataset: Path) -> None:
    import gc

    loader = BatchLoader(bytes_dataset, batch_size=2, block_size=8, prefetch=2)
    next(loader)
    thread = loader._thread
    del loader
    gc.collect()
    assert thread is not None
    thread.join(timeout=5)
    assert not thread.is_alive()


@pytest.mark.slow
def test_interpreter_exits_with_a_running_loader(bytes_dataset: Path) -> None:
    import subprocess
    import sys

    code = (
        "from gptoughts.data import BatchLoader\n"
        f"loader = BatchLoader({str(bytes_dataset)!r}, batch_size=2, block_size=8, prefetch=2)\n"
        "next(loader)\n"
        "print('ok')\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
