"""Load, merge and validate configs: YAML files left to right, then `key.sub=value` overrides.

The one override path. A misspelled key, a wrong type or a missing file raises
`ConfigError` naming the key, what was expected and the closest valid key; the CLI turns it into
one line on stderr and exit code 2.
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from bigtrain.config.data import MixtureSource, check_data
from bigtrain.config.drills import check_drill_groups
from bigtrain.config.eval import check_eval
from bigtrain.config.fault_tolerance import check_fault_tolerance
from bigtrain.config.model import check_model
from bigtrain.config.parallel import check_parallel, check_pipeline_batch
from bigtrain.config.resilience import check_rules
from bigtrain.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    DrillConfig,
    Int8Config,
    ModelConfig,
    MonitorConfig,
    OptimConfig,
    ResilienceConfig,
    TrainConfig,
)
from bigtrain.config.telemetry import check_telemetry
from bigtrain.errors import ConfigError

# Allowed values of enumerated string keys; checked after the merge.
CHOICES: dict[str, tuple[str, ...]] = {
    "model.kind": ("gpt", "hf"),
    "model.position": ("learned", "rope"),
    "model.norm": ("layernorm", "rmsnorm"),
    "model.mlp": ("gelu", "swiglu"),
    "data.source": ("shakespeare", "files", "hub", "prepared"),
    "precision.preset": ("auto", "fp32", "bf16-mixed", "fp16-mixed"),
    "precision.compute_dtype": ("auto", "bf16", "fp16", "fp32"),
    "precision.master_dtype": ("fp32",),
    "precision.optimizer_state_dtype": ("fp32", "bf16", "fp16"),
    "precision.optimizer_state_rounding": ("stochastic", "nearest"),
    "precision.optimizer_state_scaling": ("per_tensor", "none"),
    "precision.loss_scaling": ("auto", "dynamic", "static", "none"),
    "precision.int8.weight_scheme": ("symmetric",),
    "precision.int8.activation_scheme": ("affine", "symmetric"),
    "precision.int8.calibration": ("fixed", "ema"),
    "precision.fp8.recipe": ("tensorwise", "rowwise", "rowwise_with_gw_hp"),
    "optim.schedule": ("cosine", "linear", "constant"),
    "train.device": ("auto", "cpu", "cuda"),
    "monitor.nonfinite": ("rollback", "skip", "abort"),
    "monitor.kernel": ("auto", "triton", "torch"),
    "monitor.on_spike": ("rollback", "skip", "warn"),
    "parallel.backend": ("local", "fsdp", "zero"),
    "parallel.activation_checkpointing": ("none", "block", "selective"),
    "wandb.mode": ("online", "offline", "disabled"),
}

# Counts and factors that must be positive, or at least zero.
POSITIVE = (
    "model.seq_len",
    "train.max_steps",
    "train.micro_batch_size",
    "train.grad_accum_steps",
    "train.global_batch_size",
    "train.log_every",
    "train.lock_timeout_s",
    "train.eval_batches",
    "checkpoint.keep",
    "data.vocab_size",
    "data.num_proc",
    "monitor.tensor_window",
    "monitor.max_consecutive",
    "monitor.top_k",
    "resilience.snapshots",
    "resilience.lr_backoff",
    "resilience.clip_backoff",
    "resilience.max_transient_per_rank",
    "precision.fp8.patience",
    "precision.fp8.max_error",
    "precision.fp8.max_underflow",
    "monitor.straggler_factor",
)
NON_NEGATIVE = (
    "train.eval_every",
    "data.prefetch",
    "monitor.every",
    "monitor.timing_every",
    "drill.slow_s",
    "precision.fp8.check_every",
    "drill.jitter_s",
    "resilience.snapshot_every",
    "resilience.confirm_steps",
    "resilience.skip_margin",
    "resilience.lr_cooldown_steps",
    "resilience.window",
    "resilience.max_rollbacks",
    "optim.warmup_steps",
    "optim.grad_clip",
    "optim.weight_decay",
)

# Why a value that the schema names is not accepted yet; appended to the error message.
HINTS = {
    "precision.master_dtype": "FP16/BF16 master weights lose small updates; keep FP32 masters",
    "precision.int8.weight_scheme": "weights are quantized symmetric per output channel",
}


def all_keys(schema: Any = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, leaves and sections."""
    keys = []
    for f in fields(schema):
        key = f"{prefix}{f.name}"
        keys.append(key)
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            keys.extend(all_keys(type(default), key + "."))
    return keys


MOVED = {"checkpoint.init_from": "model.init_from", "wandb.hold_steps": "log.hold_steps"}
_OLD_DETECTION = (
    "spike detection was redesigned from measurements (docs/healing.md): set monitor.rules, "
    "monitor.loss.* and monitor.grad_norm.*"
)
REMOVED = {
    f"monitor.{key}": _OLD_DETECTION
    for key in (
        "spikes",
        "detector",
        "window",
        "k",
        "tensor_k",
        "warmup",
        "warmup_factor",
        "min_factor",
        "tensor_min_factor",
        "tensor_floor",
    )
}
"""Keys earlier bigtrain versions had: an error says why they went; saved configs drop them."""


RENAMED_SECTIONS = {"fault": "drill"}
"""Sections earlier bigtrain versions named otherwise: an error names the new one; saved configs
are read under it (`fault.*` were the drills, a word that fault_tolerance.* also used)."""


def _closest(key: str) -> str:
    section, _, rest = key.partition(".")
    if section in RENAMED_SECTIONS:
        return f" (the section was renamed: use '{RENAMED_SECTIONS[section]}.{rest}')"
    if key in MOVED:
        return f" (it moved: use '{MOVED[key]}')"
    if key in REMOVED:
        return f" (removed: {REMOVED[key]})"
    match = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _read_yaml(path: str) -> DictConfig:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(_not_a_file(path))
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"config file '{path}' is not valid YAML: {_yaml_problem(e)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file '{path}' must hold a mapping of sections, got {type(data).__name__}"
        )
    return OmegaConf.create(data)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """Where and what: `line 3, column 2: expected <block end>, but found ...`."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    if mark is None:
        return problem
    where = f"line {mark.line + 1}, column {mark.column + 1}"
    context = getattr(e, "context", None)
    return f"{where}: {problem}" + (f" ({context})" if context else "")


def _not_a_file(path: str) -> str:
    """A config file argument that is not a file; a dotted key without `=` was meant as one."""
    message = f"config file '{path}' not found (expected a YAML file)"
    head = path.split(".")[0]
    if "/" not in path and "." in path and head in {f.name for f in fields(Config)}:
        message += f"; to set the key, write {path}=VALUE"
    return message


def _parse_override(item: str) -> DictConfig:
    if "=" not in item or item.startswith("="):
        raise ConfigError(f"override '{item}' must look like key.sub=value")
    key = item.split("=", 1)[0]
    if key not in all_keys():
        raise ConfigError(f"unknown config key '{key}'{_closest(key)}")
    return OmegaConf.from_dotlist([item])


STEP_LISTS = tuple(f.name for f in fields(DrillConfig) if f.name.endswith("_step"))


def _steps_as_lists(cfg: DictConfig) -> DictConfig:
    """`drill.*_step` accept one step or a list of steps."""
    drill = cfg.get("drill") if isinstance(cfg, DictConfig) else None
    if isinstance(drill, DictConfig):
        for name in STEP_LISTS:
            if isinstance(drill.get(name), int):
                drill[name] = [drill[name]]
    return cfg


def _paths_as_sources(cfg: DictConfig) -> DictConfig:
    """`data.mixture` and `data.val_mixture` accept a bare path for an entry of weight 1."""
    data = cfg.get("data") if isinstance(cfg, DictConfig) else None
    if isinstance(data, DictConfig):
        for key in ("mixture", "val_mixture"):
            entries = data.get(key)
            if isinstance(entries, ListConfig):
                data[key] = [{"path": e} if isinstance(e, str) else e for e in entries]
    return cfg


def _shape(hint: Any) -> str:
    """What a field holds: `section` (a dataclass), `mapping`, `list`, `value` or `any`."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hints = [h for h in typing.get_args(hint) if h is not type(None)]
        return _shape(hints[0]) if len(hints) == 1 else "any"
    origin = typing.get_origin(hint) or hint
    if is_dataclass(origin):
        return "section"
    if origin is dict:
        return "mapping"
    if origin in (list, tuple):
        return "list"
    return "any" if origin is Any else "value"


def _check_shapes(schema: Any, given: dict, origin: str, prefix: str = "") -> None:
    """A section given a value, or a value or list given a mapping: OmegaConf's merge error says
    neither key (`int is not a subclass of MoEConfig`) nor, for a list, anything a user can read."""
    hints = typing.get_type_hints(schema)
    for name, value in given.items():
        if name not in hints:  # an unknown key: the merge names it with the closest one
            continue
        key, shape = f"{prefix}{name}", _shape(hints[name])
        if shape == "section" and isinstance(value, dict):
            _check_shapes(_section_type(hints[name]), value, origin, key + ".")
        elif shape == "section" and value is not None:
            inner = [f"{key}.{f.name}" for f in fields(_section_type(hints[name]))]
            listed = ", ".join(inner[:3]) + (", ..." if len(inner) > 3 else "")
            raise ConfigError(
                f"{origin}: key '{key}' is a section, got {value!r}: set its keys instead "
                f"({listed})"
            )
        elif shape in ("value", "list") and isinstance(value, dict):
            expected = "a list" if shape == "list" else _expected_type(key)
            raise ConfigError(f"{origin}: key '{key}' got a mapping {value!r}, expected {expected}")
        elif shape == "mapping" and isinstance(value, list):
            raise ConfigError(f"{origin}: key '{key}' got a list {value!r}, expected a mapping")


def _section_type(hint: Any) -> Any:
    """The dataclass of a section field's type hint (`MoEConfig`, or `X | None`)."""
    if is_dataclass(hint):
        return hint
    return next(h for h in typing.get_args(hint) if is_dataclass(h))


def _merge_one(base: DictConfig, other: DictConfig, origin: str) -> DictConfig:
    other = _paths_as_sources(_steps_as_lists(other))
    _check_shapes(Config, OmegaConf.to_container(other, resolve=False), origin)  # type: ignore[arg-type]
    try:
        return OmegaConf.merge(base, other)  # type: ignore[return-value]
    except ConfigKeyError as e:
        key = e.full_key or str(e.key)
        if e.object_type is MixtureSource:  # a list entry: OmegaConf knows no full key yet
            raise ConfigError(
                f"{origin}: unknown key '{key}' in a data.mixture/val_mixture entry "
                f"(expected {[f.name for f in fields(MixtureSource)]})"
            ) from None
        raise ConfigError(f"{origin}: unknown config key '{key}'{_closest(key)}") from None
    except ValidationError as e:
        if e.object_type is MixtureSource:
            types = {f.name: f.type for f in fields(MixtureSource)}
            where = f"key '{e.key}' of a data.mixture/val_mixture entry"
            expected = f"a value of type {types[e.key]}"
        elif e.full_key:
            where, expected = f"key '{e.full_key}'", _expected_type(e.full_key)
        else:  # no key known (the shapes were checked above): OmegaConf's own words
            raise ConfigError(f"{origin}: {str(e).splitlines()[0]}") from None
        raise ConfigError(f"{origin}: {where} got {e.value!r}, expected {expected}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{origin}: {str(e).splitlines()[0]}") from None


def _merge_overrides(cfg: DictConfig, items: list[str]) -> DictConfig:
    """`items` merged in order, in one merge (each merge copies the whole config: a merge per
    override took a second for twenty); when that fails, one by one, to name the override."""
    parsed = [(item, _paths_as_sources(_steps_as_lists(_parse_override(item)))) for item in items]
    if not parsed:
        return cfg
    try:
        return OmegaConf.merge(cfg, *[other for _, other in parsed])  # type: ignore[return-value]
    except (OmegaConfBaseException, TypeError):  # TypeError: a list and a mapping met
        for item, other in parsed:
            cfg = _merge_one(cfg, other, f"override '{item}'")
        return cfg


def _expected_type(key: str) -> str:
    node: Any = Config
    for part in key.split("."):
        match = [f for f in fields(node) if f.name == part]
        if not match:
            return "a valid value"
        f = match[0]
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        node = type(default) if is_dataclass(default) else None
        if node is None:
            return f"a value of type {f.type}"
    return "a section"


def load_config(files: list[str], overrides: list[str] | None = None) -> Config:
    """Merge `files` left to right onto the schema's defaults, then `overrides`; validate."""
    cfg: DictConfig = OmegaConf.structured(Config)
    for path in files:
        cfg = _merge_one(cfg, _read_yaml(path), f"config file '{path}'")
    cfg = _merge_overrides(cfg, overrides or [])
    config: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    validate(config)
    return config


def _get(root: object, key: str) -> Any:
    """The value at a dotted key under `root`."""
    value: Any = root
    for part in key.split("."):
        value = getattr(value, part)
    return value


def validate(config: Config) -> None:
    """Checks beyond each field's type, by section; raises ConfigError naming the key."""
    for key, allowed in CHOICES.items():
        value = _get(config, key)
        if value not in allowed:
            hint = f" ({HINTS[key]})" if key in HINTS else ""
            raise ConfigError(f"key '{key}' got {value!r}, expected one of {list(allowed)}{hint}")
    check_model(config.model)
    for key in POSITIVE:  # None: not set (global_batch_size, lr_cooldown_steps)
        value = _get(config, key)
        if value is not None and value <= 0:
            raise ConfigError(f"key '{key}' got {value}, expected a value > 0")
    for key in NON_NEGATIVE:
        value = _get(config, key)
        if value is not None and value < 0:
            raise ConfigError(f"key '{key}' got {value}, expected a value >= 0")
    _check_checkpoints_and_hangs(config.checkpoint, config.resilience)
    _check_optim_and_data(config.optim, config.data)
    check_data(config.data)
    check_eval(config.eval)
    check_telemetry(config.profile, config.log)
    _check_monitor_and_int8(config.monitor, config.precision.int8, config.resilience)
    check_parallel(config.parallel, config.model)
    check_pipeline_batch(config.parallel, config.train.micro_batch_size)
    if config.parallel.pipeline_parallel > 1 and config.data.document_mask:
        raise ConfigError(
            "data.document_mask=true with parallel.pipeline_parallel > 1: the per-document "
            "positions and mask come from the token ids, which the stages after the first do not "
            "see; use one stage, or document_mask=false"
        )
    check_fault_tolerance(
        config.fault_tolerance,
        config.parallel.backend,
        config.parallel.timeout_s,
        config.resilience.hang_timeout_s,
    )
    check_drill_groups(config.drill, config.fault_tolerance.groups)
    _check_train(config.train, config.model)


def _check_optim_and_data(optim: OptimConfig, data: DataConfig) -> None:
    if not optim.lr > 0.0:
        raise ConfigError(f"key 'optim.lr' got {optim.lr}, expected a positive number")
    if not 0.0 <= optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"key 'optim.min_lr_ratio' got {optim.min_lr_ratio}, expected 0..1")
    if not 0.0 < data.val_fraction < 0.5:
        raise ConfigError(f"key 'data.val_fraction' got {data.val_fraction}, expected 0 < f < 0.5")


def _check_monitor_and_int8(
    monitor: MonitorConfig, int8: Int8Config, resilience: ResilienceConfig
) -> None:
    check_rules(monitor)
    if int8.calibration_steps < 0:
        raise ConfigError(
            f"key 'precision.int8.calibration_steps' got {int8.calibration_steps}, expected >= 0"
        )
    if not 0.0 <= int8.ema_decay < 1.0:
        raise ConfigError(
            f"key 'precision.int8.ema_decay' got {int8.ema_decay}, expected 0 <= value < 1"
        )
    if not 0.0 < int8.smoothing_alpha <= 1.0:
        raise ConfigError(
            f"key 'precision.int8.smoothing_alpha' got {int8.smoothing_alpha}, expected 0 < a <= 1"
        )
    for key in ("lr_backoff", "clip_backoff"):
        value = getattr(resilience, key)
        if not 0.0 < value <= 1.0:
            raise ConfigError(f"key 'resilience.{key}' got {value}, expected 0 < value <= 1")


def _check_train(t: TrainConfig, m: ModelConfig) -> None:
    if t.stop_at_step is not None and t.stop_at_step <= 0:
        raise ConfigError(
            f"key 'train.stop_at_step' got {t.stop_at_step}, expected a positive step or null"
        )
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"key 'model.dropout' got {m.dropout}, expected 0 <= p < 1")


def to_yaml(config: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def to_dict(config: Config) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(config))  # type: ignore[return-value]


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 1e-3}} -> {"optim.lr": 1e-3}; dicts of free form (model.hf_config) too."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _check_checkpoints_and_hangs(
    checkpoint: CheckpointConfig, resilience: ResilienceConfig
) -> None:
    if checkpoint.every < -1:
        raise ConfigError(
            f"key 'checkpoint.every' got {checkpoint.every}, expected N >= 0 or -1 (never)"
        )
    hang = resilience.hang_timeout_s
    if hang is not None and hang <= 0:
        raise ConfigError(
            f"key 'resilience.hang_timeout_s' got {hang}, expected a positive number of seconds "
            "(or null: automatic)"
        )
