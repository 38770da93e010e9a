import pytest

from bigtrain.config import load_config, to_yaml
from bigtrain.errors import ConfigError
from tests.conftest import ROOT, run_cli


@pytest.mark.unit
def test_defaults_and_merge_order(tmp_path):
    a = tmp_path / "a.yaml"
    b = tmp_path / "b.yaml"
    a.write_text("train:\n  max_steps: 7\n  seed: 1\nmodel:\n  d_model: 96\n")
    b.write_text("train:\n  max_steps: 9\n")
    cfg = load_config(
        [str(a), str(b)], ["train.seed=5", "data.paths=[x.txt,y.txt]", "data.source=files"]
    )
    assert cfg.train.max_steps == 9  # later file wins
    assert cfg.train.seed == 5  # overrides win over files
    assert cfg.model.d_model == 96  # earlier file kept where later ones are silent
    assert cfg.data.paths == ["x.txt", "y.txt"]
    assert cfg.checkpoint.resume == "auto"  # schema default


@pytest.mark.unit
def test_required_keys_exist():
    cfg = load_config([], [])
    for key in (
        "train.out_dir",
        "train.max_steps",
        "train.seed",
        "train.log_every",
        "train.eval_every",
        "checkpoint.every",
        "checkpoint.keep",
        "checkpoint.resume",
        "wandb.mode",
        "parallel.backend",
        "precision.compute_dtype",
        "precision.optimizer_state_dtype",
        "precision.loss_scaling",
    ):
        section, name = key.split(".")
        assert hasattr(getattr(cfg, section), name), key


@pytest.mark.unit
def test_tiny_yaml_loads_and_round_trips(tmp_path):
    cfg = load_config([str(ROOT / "configs" / "tiny.yaml")])
    assert cfg.data.source == "shakespeare"
    dumped = tmp_path / "resolved.yaml"
    dumped.write_text(to_yaml(cfg))
    assert load_config([str(dumped)]) == cfg


@pytest.mark.unit
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["train.max_stpes=5"],
            "unknown config key 'train.max_stpes' (did you mean 'train.max_steps'?)",
        ),
        (["trian.seed=1"], "unknown config key 'trian.seed' (did you mean 'train.seed'?)"),
        (["train.max_steps=ten"], "key 'train.max_steps' got 'ten', expected a value of type int"),
        (
            ["wandb.mode=loud"],
            "key 'wandb.mode' got 'loud', expected one of ['online', 'offline', 'disabled']",
        ),
        (["model.n_heads=3"], "key 'model.n_heads' (3) must divide model.d_model (128)"),
        (["train.max_steps=0"], "key 'train.max_steps' got 0, expected a value > 0"),
        (
            ["precision.master_dtype=fp16"],
            "key 'precision.master_dtype' got 'fp16', expected one of ['fp32']",
        ),
        (["data.source=files"], "data.source=files needs 'data.paths'"),
        (
            ["data.paths=[a.txt]"],
            "key 'data.paths' is set, but data.source is 'shakespeare': data.paths is read only "
            "with data.source=files (set data.source=files, or leave data.paths out)",
        ),
        (
            ["data.source=hub", "data.hub_name=org/web", "data.paths=[a.txt]"],
            "key 'data.paths' is set, but data.source is 'hub'",
        ),
        (
            ["data.source=prepared", "data.mixture=[/a]", "data.paths=[a.txt]"],
            "key 'data.paths' is set, but data.source is 'prepared'",
        ),
        (
            ["data.source=files", "data.paths=[a.txt]", "data.hub_name=org/web"],
            "key 'data.hub_name' is set ('org/web'), but data.source is 'files': data.hub_name "
            "is read only with data.source=hub (set data.source=hub, or data.hub_name=null)",
        ),
        (["data.hub_name=org/web"], "key 'data.hub_name' is set ('org/web'), but data.source"),
        (
            ["resilience.lr_backoff=2"],
            "key 'resilience.lr_backoff' got 2.0, expected 0 < value <= 1",
        ),
        (["monitor.on_spike=ignore"], "key 'monitor.on_spike' got 'ignore', expected one of"),
        (
            ["monitor.rules=[loss,gradnorm]"],
            "key 'monitor.rules' got unknown rule names ['gradnorm'], expected a list of loss, "
            "grad_norm",
        ),
        (
            ["monitor.loss.window=5"],
            "key 'monitor.loss.min_values' got 10, expected 1..monitor.loss.window (5): a window "
            "shorter than the values it waits for never fires",
        ),
        (
            ["monitor.grad_norm.factor=0.5"],
            "key 'monitor.grad_norm.factor' got 0.5, expected a value > 1",
        ),
        (["monitor.loss.sigmas=-1"], "key 'monitor.loss.sigmas' got -1.0, expected a value >= 0"),
        (
            ["monitor.suspicion.factor=1"],
            "key 'monitor.suspicion.factor' got 1.0, expected a value > 1",
        ),
        (
            ["monitor.suspicion.alone_factor=0.5"],
            "key 'monitor.suspicion.alone_factor' got 0.5, expected a value > 1",
        ),
        (
            ["monitor.suspicion.alone_sigmas=-2"],
            "key 'monitor.suspicion.alone_sigmas' got -2.0, expected a value >= 0",
        ),
        (
            ["monitor.suspicion.pair_factor=1"],
            "key 'monitor.suspicion.pair_factor' got 1.0, expected a value > 1",
        ),
        (
            ["monitor.suspicion.pair_sigmas=-1"],
            "key 'monitor.suspicion.pair_sigmas' got -1.0, expected a value >= 0",
        ),
        (
            ["monitor.suspicion.excursion=-1"],
            "key 'monitor.suspicion.excursion' got -1.0, expected a value >= 0",
        ),
        (
            ["monitor.suspicion.lone_share=-0.5"],
            "key 'monitor.suspicion.lone_share' got -0.5, expected a value >= 0",
        ),
        (
            ["monitor.suspicion.rival_share=-0.5"],
            "key 'monitor.suspicion.rival_share' got -0.5, expected a value >= 0",
        ),
        (
            ["monitor.checksum.tolerance=1.5"],
            "key 'monitor.checksum.tolerance' got 1.5, expected a value in (0, 1)",
        ),
        (
            ["monitor.checksum.until_step=-2"],
            "key 'monitor.checksum.until_step' got -2, expected a step >= 0 or -1",
        ),
        (
            ["monitor.suspicion.company=0"],
            "key 'monitor.suspicion.company' got 0.0, expected a value > 0 (inf: off)",
        ),
        (
            ["monitor.suspicion.lead=0.5"],
            "key 'monitor.suspicion.lead' got 0.5, expected a value >= 1",
        ),
        (
            ["monitor.suspicion.neighbours=0"],
            "key 'monitor.suspicion.neighbours' got 0, expected a value >= 1",
        ),
        (["monitor.loss.window=0"], "key 'monitor.loss.window' got 0, expected a value >= 1"),
        (["monitor.tensor_window=0"], "key 'monitor.tensor_window' got 0, expected a value > 0"),
        (
            ["monitor.k=3"],
            "unknown config key 'monitor.k' (removed: spike detection was redesigned from "
            "measurements (docs/healing.md): set monitor.rules, monitor.loss.* and "
            "monitor.grad_norm.*)",
        ),
        (
            ["resilience.lr_cooldown_steps=-5"],
            "key 'resilience.lr_cooldown_steps' got -5, expected a value >= 0",
        ),
        (["drill.kill_step=soon"], "key 'drill.kill_step"),
        (["max_steps"], "override 'max_steps' must look like key.sub=value"),
        (["checkpoint.every=-2"], "key 'checkpoint.every' got -2, expected N >= 0 or -1 (never)"),
        (["eval.sample_every=-1"], "key 'eval.sample_every' got -1, expected N >= 0 (0: off)"),
        (
            ["eval.sample_temperature=-0.5"],
            "key 'eval.sample_temperature' got -0.5, expected >= 0 (0: greedy)",
        ),
        (
            ["eval.sample_max_new_tokens=0"],
            "key 'eval.sample_max_new_tokens' got 0, expected >= 1",
        ),
        (
            ["eval.sample_every=5", "eval.sample_prompts=[]"],
            "key 'eval.sample_prompts' is empty but eval.sample_every is set",
        ),
        (["eval.sample_evry=5"], "(did you mean 'eval.sample_every'?)"),
    ],
)
def test_bad_overrides_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config([], overrides)
    assert message in str(err.value)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "model.moe=5",
            "override 'model.moe=5': key 'model.moe' is a section, got 5: set its keys instead "
            "(model.moe.experts, model.moe.top_k, model.moe.every, ...)",
        ),
        ("model=5", "key 'model' is a section, got 5: set its keys instead (model.kind, "),
        ("model.moe=[1,2]", "key 'model.moe' is a section, got [1, 2]"),
        ("train={max_steps: 3, seed: {a: 1}}", "key 'train.seed' got a mapping {'a': 1}"),
        (
            "model.dropout={a: 1}",
            "key 'model.dropout' got a mapping {'a': 1}, expected a value of type float",
        ),
        ("data.mixture={a: 1}", "key 'data.mixture' got a mapping {'a': 1}, expected a list"),
        ("parallel.tp_plan=[1]", "key 'parallel.tp_plan' got a list [1], expected a mapping"),
    ],
)
def test_a_section_given_a_value_and_a_value_given_a_mapping_name_the_key(override, message):
    """OmegaConf's own errors name no key for these (`int is not a subclass of MoEConfig`) or
    are no ValueError at all (`TypeError: Cannot merge incompatible container types`)."""
    with pytest.raises(ConfigError) as err:
        load_config([str(ROOT / "configs" / "moe-tiny.yaml")], ["train.seed=3", override])
    assert message in str(err.value)


@pytest.mark.unit
def test_a_section_given_a_value_in_yaml_names_file_and_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  n_layers: 2\n  moe: 5\n")
    with pytest.raises(ConfigError) as err:
        load_config([str(bad)])
    assert str(err.value).startswith(f"config file '{bad}': key 'model.moe' is a section, got 5")


@pytest.mark.unit
def test_unknown_key_in_yaml_names_file_and_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config([str(bad)])
    assert f"config file '{bad}'" in str(err.value)
    assert "optim.learning_rate" in str(err.value)


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["train", "missing.yaml"], "config file 'missing.yaml' not found"),
        (["train", "configs/tiny.yaml", "train.lr=1"], "unknown config key 'train.lr'"),
        (
            ["train", "configs/tiny.yaml", "train.seed=abc"],
            "key 'train.seed' got 'abc', expected a value of type int",
        ),
        (
            ["config", "show", "configs/moe-tiny.yaml", "model.moe=5"],
            "key 'model.moe' is a section, got 5",
        ),
    ],
)
def test_cli_config_errors_exit_2_without_traceback(args, expected):
    result = run_cli(*args)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0  # one line


@pytest.mark.e2e
def test_cli_accepts_local_rank_before_and_after_subcommand():
    for args in (
        ["--local_rank=0", "train", "nope.yaml"],
        ["train", "--local_rank=0", "nope.yaml"],
    ):
        result = run_cli(*args)
        assert result.returncode == 2
        assert "config file 'nope.yaml' not found" in result.stderr


@pytest.mark.unit
def test_a_hang_timeout_must_be_positive():
    with pytest.raises(
        ConfigError, match="resilience.hang_timeout_s' got 0.0, expected a positive"
    ):
        load_config([], ["resilience.hang_timeout_s=0"])


@pytest.mark.unit
def test_a_global_batch_size_must_be_positive():
    with pytest.raises(ConfigError, match="train.global_batch_size' got 0"):
        load_config([], ["train.global_batch_size=0"])


@pytest.mark.unit
def test_a_moved_key_says_where_it_went():
    with pytest.raises(ConfigError, match="it moved: use 'model.init_from'"):
        load_config([], ["checkpoint.init_from=/x"])


@pytest.mark.unit
def test_a_saved_config_with_a_moved_key_still_loads(tmp_path):
    from bigtrain.config import load_saved_config

    saved = tmp_path / "config.yaml"
    saved.write_text("checkpoint:\n  init_from: /runs/a\n  keep: 2\ntrain:\n  max_steps: 7\n")
    cfg = load_saved_config(saved)
    assert cfg.model.init_from == "/runs/a" and cfg.checkpoint.keep == 2
    saved.write_text("checkpoint:\n  init_from: null\n")
    assert load_saved_config(saved).model.init_from is None


@pytest.mark.unit
def test_the_drill_section_was_fault_a_saved_one_is_read_a_new_one_is_refused(tmp_path):
    """`fault.*` were the drills (a word fault_tolerance.* uses too): a config that still says
    so gets an error naming the new key; a run directory or checkpoint of an earlier bigtrain
    loads with its drills under `drill.*` and shows no change of them on resume."""
    from bigtrain.config import config_changes, load_saved_config

    with pytest.raises(ConfigError, match="section was renamed: use 'drill.nan_grad_step'"):
        load_config([], ["fault.nan_grad_step=3"])
    drilled = load_config([], ["drill.nan_grad_step=3", "drill.rank=1"])
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(drilled).replace("\ndrill:\n", "\nfault:\n"))
    assert "\nfault:\n" in saved.read_text()
    cfg = load_saved_config(saved)
    assert cfg.drill.nan_grad_step == [3] and cfg.drill.rank == 1
    assert config_changes(saved.read_text(), drilled) == {}


@pytest.mark.unit
def test_a_saved_config_of_the_old_spike_detection_still_loads(tmp_path):
    """Run directories and checkpoints of earlier bigtrain hold monitor.k, tensor_k, ...:
    export and convert still read them; the keys are dropped, the new rules' defaults apply."""
    from bigtrain.config import load_saved_config

    saved = tmp_path / "config.yaml"
    saved.write_text(
        "monitor:\n  spikes: [loss, tensor_max]\n  k: 3.0\n  tensor_floor: 0.001\n  every: 7\n"
    )
    cfg = load_saved_config(saved)
    assert cfg.monitor.every == 7
    assert cfg.monitor.rules == ["loss", "grad_norm", "router_logits", "router_spread"]


@pytest.mark.unit
def test_a_yaml_syntax_error_names_the_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  n_layers: 2\n train:\n  max_steps: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config([str(bad)])
    assert str(e.value).startswith(f"config file '{bad}' is not valid YAML: line 3, column 2: ")


@pytest.mark.unit
def test_a_bare_key_argument_suggests_key_equals_value():
    with pytest.raises(ConfigError) as e:
        load_config(["configs/tiny.yaml", "train.max_steps"])
    assert str(e.value) == (
        "config file 'train.max_steps' not found (expected a YAML file); to set the key, write "
        "train.max_steps=VALUE"
    )
    with pytest.raises(ConfigError) as e:
        load_config(["configs/nothere.yaml"])
    assert str(e.value) == "config file 'configs/nothere.yaml' not found (expected a YAML file)"
