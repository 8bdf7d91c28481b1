"""The typed configuration of a run: what callers import from ``gptoughts.config``.

A run is described by one :class:`Config` of typed sections (:mod:`.schema`, every field documented where it is
declared), composed from TOML presets, size defaults and ``--section.key value`` overrides (:mod:`.loading`),
and checked strictly (:mod:`.validation`): an unknown key or a wrong type raises
:class:`~gptoughts.errors.ConfigError` naming the closest valid key. Values are checked against their
annotations by :mod:`gptoughts.coerce`.
"""

from gptoughts.config.loading import (
    DEFAULT_PRESET,
    PRESET_DIR,
    SIZES_FILE,
    config_from_toml_text,
    default_out,
    finetune_defaults,
    from_dict,
    is_task_file,
    list_presets,
    load_config,
    read_toml,
    size_defaults,
    to_toml,
)
from gptoughts.config.schema import (
    MOVED,
    SECTIONS,
    CheckpointConfig,
    Config,
    DataConfig,
    DpoConfig,
    EvalConfig,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    PerfConfig,
    PhaseConfig,
    RecoveryConfig,
    RunConfig,
    TrainConfig,
    describe_fields,
    field_docs,
)
from gptoughts.config.validation import MAX_BLOCK_SIZE, check_parallel, check_train_ranges, validate

__all__ = [
    "DEFAULT_PRESET",
    "MAX_BLOCK_SIZE",
    "MOVED",
    "PRESET_DIR",
    "SECTIONS",
    "SIZES_FILE",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "EvalConfig",
    "DpoConfig",
    "LoraConfig",
    "ModelConfig",
    "ParallelConfig",
    "PerfConfig",
    "PhaseConfig",
    "RecoveryConfig",
    "RunConfig",
    "TrainConfig",
    "check_parallel",
    "check_train_ranges",
    "config_from_toml_text",
    "default_out",
    "describe_fields",
    "field_docs",
    "finetune_defaults",
    "from_dict",
    "is_task_file",
    "list_presets",
    "load_config",
    "read_toml",
    "size_defaults",
    "to_toml",
    "validate",
]
