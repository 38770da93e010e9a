"""The typed configuration: one dataclass per section with a docstring per field and its checks
beside it (model.py, parallel.py, data.py, resilience.py, ...; the whole tree in schema.py), YAML
files and `key=value` overrides merged and validated (load.py), a saved run's config (saved.py),
and the documentation read from the fields (docs.py)."""

from bigtrain.config.data import MixtureSource
from bigtrain.config.eval import EvalConfig
from bigtrain.config.load import (
    load_config,
    to_dict,
    to_yaml,
    validate,
)
from bigtrain.config.saved import config_changes, load_saved_config
from bigtrain.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    DrillConfig,
    FaultToleranceConfig,
    ModelConfig,
    MonitorConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainConfig,
    WandbConfig,
)

__all__ = [
    "config_changes",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "EvalConfig",
    "DrillConfig",
    "FaultToleranceConfig",
    "MixtureSource",
    "ModelConfig",
    "MonitorConfig",
    "OptimConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "TrainConfig",
    "WandbConfig",
    "load_config",
    "load_saved_config",
    "to_dict",
    "to_yaml",
    "validate",
]
