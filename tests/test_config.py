from __future__ import annotations

import re

import pytest

from gptoughts.config import Config, config_from_toml_text, list_presets, load_config, to_toml
from gptoughts.errors import ConfigError


def test_default_preset_is_quickstart():
    cfg = load_config()
    assert cfg.data.sources == ["@stdlib"]
    assert cfg.model.family == "llama"
    assert cfg.run.out == "runs/quickstart"


def test_dotted_overrides_are_typed():
    cfg = load_config(
        "quickstart",
        {
            "train.max_steps": "7",
            "train.learning_rate": "1e-3",
            "run.overwrite": "true",
            "train.batch_size": "4",
            "data.sources": ["a.txt", "b.txt"],
        },
    )
    assert cfg.train.max_steps == 7 and isinstance(cfg.train.max_steps, int)
    assert cfg.train.learning_rate == pytest.approx(1e-3)
    assert cfg.run.overwrite is True
    assert cfg.train.batch_size == 4
    assert cfg.data.sources == ["a.txt", "b.txt"]
    assert load_config("quickstart", {"train.batch_size": "auto"}).train.batch_size == "auto"
    assert load_config("quickstart", {"train.max_tokens": "1e6"}).train.max_tokens == 1_000_000


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("max_steps = 5", "`max_steps`: write it under [train]"),
        ("eval_interval = 5", "`eval_interval`: write it under [eval]"),
        (
            'given = ["train.grad_accum"]',
            "`given` (valid: checkpoint, data",
        ),  # Config's own, not a key of the file
        ("flags = 3", "`flags` (valid: checkpoint, data"),
        ("[modle]\nfamily = 'llama'", "did you mean `model`"),
    ],
)
def test_a_key_outside_the_sections_of_a_toml_file_is_named_with_its_table(text, needle):
    """A key above the tables was refused with Config's attributes as the valid keys (given, flags, resolved...),
    and one of them, which no TOML type converts to, raised a TypeError with a traceback."""
    with pytest.raises(ConfigError) as e:
        config_from_toml_text(text)
    assert needle in str(e.value) and "resolved" not in str(e.value)


@pytest.mark.parametrize(
    ("key", "value", "rule"),
    [
        ("train.weight_decay", "-1", ">= 0"),
        ("train.weight_decay", "nan", ">= 0"),
        ("train.beta1", "1.5", "in [0, 1)"),
        ("train.beta2", "-0.1", "in [0, 1)"),
        ("train.eps", "-1", ">= 0"),
        ("eval.sample_temperature", "-1", ">= 0"),
    ],
)
def test_optimizer_and_sampling_numbers_out_of_range_are_refused_before_the_run(key, value, rule):
    """torch's AdamW refused a beta or eps out of range only as it was built (a traceback, the run's folder written),
    took a negative weight decay, and a negative temperature failed each sample in the middle of the run."""
    with pytest.raises(ConfigError, match=f"{key} must be {re.escape(rule)}"):
        load_config(overrides={"data.sources": ["x.txt"], key: value})


def test_unknown_key_names_closest():
    with pytest.raises(ConfigError, match="max_steps"):
        load_config("quickstart", {"train.max_step": 3})
    with pytest.raises(ConfigError, match="train"):
        load_config("quickstart", {"trian.max_steps": 3})


def test_unknown_model_key_names_closest():
    with pytest.raises(ConfigError, match="n_layers"):
        load_config("quickstart", {"model.n_layer": 3})


def test_wrong_type_is_an_error():
    with pytest.raises(ConfigError, match="train.max_steps must be an integer"):
        load_config("quickstart", {"train.max_steps": "many"})
    with pytest.raises(ConfigError, match="true or false"):
        load_config("quickstart", {"run.overwrite": "perhaps"})


def test_bad_choice_is_an_error():
    with pytest.raises(ConfigError, match="cosine"):
        load_config("quickstart", {"train.schedule": "cosin"})


def test_unknown_preset_names_closest():
    with pytest.raises(ConfigError, match="quickstart"):
        load_config("quickstar")


def test_toml_roundtrip(tmp_path):
    cfg = load_config("quickstart", {"train.max_steps": 5, "model.n_layers": 3})
    text = to_toml(cfg)
    back = config_from_toml_text(text)
    assert back == cfg
    # and a user file with `base` inherits from a preset
    f = tmp_path / "mine.toml"
    f.write_text('base = "quickstart"\n[train]\nmax_steps = 11\n')
    mine = load_config(str(f))
    assert mine.train.max_steps == 11 and mine.data.sources == ["@stdlib"]


def test_invalid_toml_is_a_config_error(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[train\nmax_steps = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(f))


@pytest.mark.parametrize("preset", list_presets())
def test_every_preset_loads(preset):
    assert isinstance(load_config(preset), Config)


def test_model_overrides_from_the_cli_are_typed():
    cfg = load_config(
        "default",
        {
            "model.n_layers": "3",
            "model.rope_theta": "5e5",
            "model.tie_embeddings": "true",
            "model.rope_scaling": "none",
        },
    )
    assert cfg.model.overrides["n_layers"] == 3
    assert cfg.model.overrides["rope_theta"] == 500000.0
    assert cfg.model.overrides["tie_embeddings"] is True
    assert cfg.model.overrides["rope_scaling"] is None
    with pytest.raises(ConfigError, match="n_layers"):
        load_config("default", {"model.n_layers": "three"})


@pytest.mark.parametrize("family", ["inl", "gpt2", "deepseek", "llada"])
def test_switching_family_drops_the_presets_architecture(family):
    cfg = load_config("quickstart", {"model.family": family})  # quickstart pins a Llama shape
    assert cfg.model.family == family and cfg.model.overrides == {} and cfg.model.size == "debug"
    assert cfg.data.sources == ["@stdlib"]  # the rest of the named preset still applies
    same = load_config("quickstart", {"model.family": "llama"})
    assert same.model.overrides["d_model"] == 320
    # Without a preset, naming a family is not a bare run: nothing of the quickstart applies (issue 10's rule).
    named = load_config(None, {"model.family": family})
    assert named.model.overrides == {} and named.data.sources == [] and named.data.max_bytes is None


def test_parallel_strategy_choices_and_fsdp_limits():
    assert load_config("default", {"parallel.strategy": "fsdp"}).parallel.strategy == "fsdp"
    with pytest.raises(ConfigError, match="parallel.strategy"):
        load_config("default", {"parallel.strategy": "zero3"})
    with pytest.raises(ConfigError, match="LoRA runs are data-parallel with DDP"):
        load_config("finetune", {"parallel.strategy": "fsdp", "lora.enabled": True, "model.init_from": "/x"})


def test_fsdp_needs_torchrun():
    import torch

    from gptoughts.parallel import dist

    with pytest.raises(ConfigError, match="parallel.strategy = fsdp needs several processes"):
        dist.init(torch.device("cpu"), strategy="fsdp")


def test_train_is_split_into_eval_checkpoint_recovery_and_old_keys_still_load(tmp_path):
    cfg = load_config(
        "default",
        {
            "train.eval_interval": "7",
            "checkpoint.keep_last": 5,
            "train.nan_policy": "stop",
            "train.sample_prompts": ["hi"],
        },
    )
    assert (cfg.eval.eval_interval, cfg.checkpoint.keep_last, cfg.recovery.nan_policy) == (7, 5, "stop")
    assert cfg.eval.sample_prompts == ["hi"] and not hasattr(cfg.train, "eval_interval")
    old = tmp_path / "old.toml"  # a config.toml written before the split
    old.write_text("[train]\nmax_steps = 3\neval_interval = 9\nsave_interval = 4\nmax_bad_steps = 2\n")
    back = load_config(str(old))
    assert (
        back.train.max_steps,
        back.eval.eval_interval,
        back.checkpoint.save_interval,
        back.recovery.max_bad_steps,
    ) == (3, 9, 4, 2)
    assert "[recovery]" in to_toml(back) and config_from_toml_text(to_toml(back)) == back
    with pytest.raises(ConfigError, match="eval.eval_interval must be >= 0"):
        load_config("default", {"eval.eval_interval": -1})


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"parallel.tp": 0}, "parallel.tp must be >= 1"),
        ({"parallel.pp": -1}, "parallel.pp must be >= 1"),
        ({"parallel.pp_microbatches": -2}, "pp_microbatches must be >= 0"),
        ({"parallel.pp": 2, "parallel.pp_layers": [3, 3, 3]}, "needs one per stage"),
        ({"parallel.tp": 2, "parallel.strategy": "none"}, "needs torchrun"),
        ({"parallel.reshard_after_forward": "sometimes"}, "must be true, false or auto"),
        ({"parallel.ddp_bucket_mb": -1}, "ddp_bucket_mb must be >= 0"),
    ],
)
def test_parallel_ranges(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, {"model.size": "debug", **overrides})


def test_tensor_parallel_without_enough_processes_is_one_line() -> None:
    import torch

    from gptoughts.parallel import dist

    with pytest.raises(ConfigError, match="needs 2 processes or a multiple: launch with `torchrun"):
        dist.init(torch.device("cpu"), tp=2)
    info = dist.init(torch.device("cpu"))
    assert (info.dp_size, info.dp_rank, info.tp_rank, info.pp_rank, info.model_parallel) == (
        1,
        0,
        0,
        0,
        False,
    )
    # rank order (pp, dp, tp), tp innermost: rank 5 of 8 with tp 2, pp 2 is stage 1, dp rank 0, tp rank 1
    info = dist.DistInfo(rank=5, world_size=8, strategy="fsdp", tp=2, pp=2)
    assert (info.dp_size, info.dp_rank, info.tp_rank, info.pp_rank) == (2, 0, 1, 1)


def test_lora_is_refused_under_offload_as_under_fsdp():
    from gptoughts.config.validation import _validate_finetune

    cfg = Config()
    cfg.lora.enabled, cfg.parallel.cpu_offload = (
        True,
        True,
    )  # offload means FSDP2, which LoRA does not run under
    with pytest.raises(ConfigError, match="LoRA runs are data-parallel with DDP"):
        _validate_finetune(cfg)


def test_fsdp_keeps_blocks_gathered_when_the_estimate_fits() -> None:
    """auto: every block stays gathered until its backward where the estimate with them kept fits 80% of the
    GPU (1b on two 141 GB GPUs), and they are resharded where it does not (8b on two 40 GiB GPUs)."""
    from types import SimpleNamespace

    import torch

    from gptoughts.parallel.dist import DistInfo
    from gptoughts.training.resolve import reshard_rule

    info = DistInfo(world_size=2, strategy="fsdp")
    cuda = torch.device("cuda")

    def hw(gib: float) -> SimpleNamespace:
        return SimpleNamespace(memory_bytes=int(gib * 2**30))

    def cfg(size: str, **over) -> Config:
        return load_config(None, {"model.size": size, "train.batch_size": 1, **over})

    keep, why = reshard_rule(cfg("1b"), info, hw(141), cuda)
    assert keep is False and why.startswith("auto: blocks kept")
    keep, why = reshard_rule(cfg("8b"), info, hw(40), cuda)
    assert keep is True and "resharded" in why
    assert reshard_rule(cfg("1b", **{"parallel.reshard_after_forward": True}), info, hw(141), cuda) == (
        True,
        "asked",
    )
    assert reshard_rule(cfg("1b"), info, hw(141), torch.device("cpu"))[0] is True


def test_ddp_buckets_grow_with_the_model() -> None:
    import torch
    from torch import nn

    from gptoughts.parallel.dist import ddp_bucket_mb

    assert ddp_bucket_mb(nn.Linear(10, 10)) == 25  # torch's default for small models
    huge = nn.ParameterList([nn.Parameter(torch.empty(1024**3, device="meta"))])  # 4 GiB of gradients
    assert ddp_bucket_mb(huge) == 204
    assert ddp_bucket_mb(huge, asked=64) == 64


def test_a_size_in_capitals_is_the_size():
    # A newcomer's --size DEBUG trained the debug size into runs/llama-DEBUG, and the plan said "llama/DEBUG".
    from gptoughts.config import load_config

    cfg = load_config(None, {"model.size": "DEBUG", "data.sources": ["x.txt"]})
    assert cfg.model.size == "debug" and cfg.run.out.endswith("llama-debug")
