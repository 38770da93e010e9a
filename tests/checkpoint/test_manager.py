import json
from pathlib import Path

import pytest
import torch

from bigtrain.build import build_trainer
from bigtrain.checkpoint.manager import CheckpointManager
from bigtrain.checkpoint.manifest import CheckpointError, verify
from bigtrain.checkpoint.state_io import StateIO
from bigtrain.errors import ConfigError
from bigtrain.parallel.env import DistEnv
from bigtrain.runner import run
from bigtrain.store.rundir import read_jsonl
from tests.conftest import run_cli

pytestmark = pytest.mark.e2e

ENV = DistEnv()


def test_manifest_lists_every_file_with_size_and_sha256(micro):
    cfg = micro("train.max_steps=10")
    run(cfg, ENV)
    path = Path(cfg.train.out_dir) / "checkpoints" / "step_00000010"
    manifest = verify(path)
    # the one format of every backend (checkpoint/state.py); a synchronous save (this last
    # step's) writes one DCP file per writer thread
    dcp_files = {name for name in manifest["files"] if name.startswith("dcp/__0_")}
    assert dcp_files and all(name.endswith(".distcp") for name in dcp_files)
    assert set(manifest["files"]) == dcp_files | {
        "dcp/.metadata",
        "backend.json",
        "trainer.json",
        "rng_rank0.pt",
        "local_rank0.pt",  # this rank's own state: its suspicion tier's shard history
        "config.yaml",
        "tokenizer/tokenizer.json",  # the run's tokenizer travels with each checkpoint
        "tokenizer/tokenizer_config.json",
    }
    assert manifest["step"] == 10 and manifest["backend"] == "local" and manifest["world_size"] == 1
    assert manifest["data"]["cursor"] == 80 and manifest["data"]["skip_windows"] == []
    assert {"torch", "python"} <= set(manifest["versions"])
    assert len(manifest["config_hash"]) == 16
    for name, meta in manifest["files"].items():
        assert (path / name).stat().st_size == meta["size"]


def test_a_ranks_local_state_comes_back_only_at_the_same_world_size(micro):
    """Rank r's shard history describes rank r's shards: another world size shards the tensors
    otherwise, so its file is left alone and the history starts empty, with the suspicion tier's
    own series of those shards (trainer.json's)."""
    cfg = micro("train.max_steps=10")
    run(cfg, ENV)
    path = Path(cfg.train.out_dir) / "checkpoints" / "step_00000010"
    trainer = build_trainer(cfg, ENV)  # resumed at step 10 from `path`
    try:
        history, series = trainer.monitor.history, trainer.healer.detector.suspicion.values
        assert len(series) >= 8  # steps 3-10 had rises (the first needs a history)
        assert history.count == 10 and torch.isfinite(history.values[:10]).any(dim=1).all()
        same = trainer.healer.manager.load(path, trainer.backend)
        assert torch.equal(
            same["local"]["shards"]["levels"].nan_to_num(), history.values.nan_to_num()
        )
        grown = CheckpointManager(path.parent, keep=3, rank=0, world_size=2)
        assert "local" not in grown.load(path, trainer.backend)
        trainer.run.load_state_dict(grown.load(path, trainer.backend))
        assert history.count == 0 and torch.isnan(history.values).all() and len(series) == 0
        trainer.run.load_state_dict(same)
        assert history.count == 10 and len(series) >= 8
    finally:
        trainer.callbacks.close()


def test_keep_prunes_old_checkpoints(micro):
    cfg = micro("train.max_steps=20", "checkpoint.every=5", "checkpoint.keep=2")
    run(cfg, ENV)
    names = sorted(p.name for p in (Path(cfg.train.out_dir) / "checkpoints").iterdir())
    assert names == ["step_00000015", "step_00000020"]


def test_interrupted_write_leaves_the_previous_checkpoint_loadable(micro, monkeypatch):
    cfg = micro("train.max_steps=20", "checkpoint.every=10")
    original = StateIO.save

    def crash_on_second_save(self, holder, directory, host_state=None):
        files = original(self, holder, directory, host_state)
        if directory.name.endswith("00000020"):
            raise KeyboardInterrupt("killed mid-write")  # files written, no manifest, no rename
        return files

    monkeypatch.setattr(StateIO, "save", crash_on_second_save)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, ENV)
    root = Path(cfg.train.out_dir) / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [".tmp-step_00000020", "step_00000010"]
    found = CheckpointManager(root, keep=3).newest_valid()
    assert found is not None and found[0].name == "step_00000010"

    monkeypatch.setattr(StateIO, "save", original)
    final = run(cfg, ENV)  # resumes from step 10, rewrites step 20, cleans the stale tmp dir
    assert final["step"] == 20
    assert sorted(p.name for p in root.iterdir()) == ["step_00000010", "step_00000020"]
    straight = run(micro("train.max_steps=20", "checkpoint.every=10", out="straight"), ENV)
    assert final["fingerprint"] == straight["fingerprint"]


def test_corrupted_newest_checkpoint_falls_back_to_the_previous(micro):
    cfg = micro("train.max_steps=20", "checkpoint.every=10", "train.stop_at_step=20")
    run(cfg, ENV)
    root = Path(cfg.train.out_dir) / "checkpoints"
    weights = root / "step_00000020" / "dcp" / "__0_0.distcp"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="dcp/__0_0.distcp' fails its sha256 check"):
        verify(root / "step_00000020")

    final = run(micro("train.max_steps=20", "checkpoint.every=10"), ENV)
    assert final["step"] == 20
    events = read_jsonl(Path(cfg.train.out_dir) / "events.jsonl")
    invalid = [e for e in events if e["kind"] == "checkpoint_invalid"]
    assert len(invalid) == 1 and "step_00000020" in invalid[0]["path"]
    resume = [e for e in events if e["kind"] == "resume"]
    assert resume[-1]["path"].endswith("step_00000010")
    # the corrupted one was kept aside, not deleted
    assert any(p.name.startswith("step_00000020.replaced-") for p in root.iterdir())


def test_directory_without_manifest_is_never_loaded(micro):
    cfg = micro("train.max_steps=10")
    run(cfg, ENV)
    root = Path(cfg.train.out_dir) / "checkpoints"
    (root / "step_00000010" / "manifest.json").unlink()
    assert CheckpointManager(root, keep=3).newest_valid() is None


def test_changed_model_on_resume_is_refused_unless_allowed(micro):
    run(micro("train.max_steps=10"), ENV)
    with pytest.raises(ConfigError, match="different model.d_model"):
        run(micro("train.max_steps=20", "model.d_model=32"), ENV)
    with pytest.raises(ConfigError) as error:  # another global batch, asked for explicitly
        run(micro("train.max_steps=20", "train.global_batch_size=16"), ENV)
    assert "different global_batch_size (8 -> 16) (train.global_batch_size=16 is set" in str(
        error.value
    )
    # A smaller micro-batch set for this resume keeps the global batch: accumulation makes up.
    final = run(micro("train.max_steps=12", "train.micro_batch_size=4"), ENV)
    assert final["step"] == 12
    (resume,) = [
        e for e in read_jsonl(Path(micro().train.out_dir) / "events.jsonl") if e["kind"] == "resume"
    ][-1:]
    assert resume["batch"] == (
        "global batch kept at 8 sequences on 1 data-parallel ranks: train.grad_accum_steps 1 -> 2 "
        "(this config gives 4 here)"
    )
    # the run's length may change freely; other settings too with the explicit switch
    final = run(
        micro(
            "train.max_steps=14",
            "train.global_batch_size=16",
            "checkpoint.allow_config_change=true",
        ),
        ENV,
    )
    assert final["step"] == 14


def test_a_changed_shape_is_refused_even_with_allow_config_change(micro, micro_args):
    run(micro("train.max_steps=10"), ENV)
    with pytest.raises(
        ConfigError, match=r"other shapes .*blocks.0.attn.proj.weight \[64, 64\] -> \[32, 32\]"
    ):
        run(micro("model.d_model=32", "checkpoint.allow_config_change=true"), ENV)
    cli = run_cli("train", *micro_args("model.d_model=32", "checkpoint.allow_config_change=true"))
    assert cli.returncode == 2 and "cannot be loaded" in cli.stderr
    assert "Traceback" not in cli.stderr


def test_resume_event_lists_every_changed_key(micro):
    run(micro("train.max_steps=10"), ENV)
    cfg = micro("train.max_steps=12", "optim.lr=1e-3")
    run(cfg, ENV)
    (resume,) = [
        e for e in read_jsonl(Path(cfg.train.out_dir) / "events.jsonl") if e["kind"] == "resume"
    ]
    assert resume["changed"] == ["optim.lr", "train.max_steps"]
    assert resume["changes"]["optim.lr"] == [3e-3, 1e-3]
    assert resume["changes"]["train.max_steps"] == [10, 12]
    assert resume["identity_changed"] == []


def test_init_from_starts_a_new_run_from_anothers_weights(micro):
    from bigtrain.build import build

    first = micro("train.max_steps=10", out="first")
    done = run(first, ENV)
    source = Path(first.train.out_dir) / "checkpoints" / "step_00000010"
    built = build(micro(f"model.init_from={source}", "optim.lr=1e-3", out="second"), ENV)
    trainer = built.trainer
    try:
        assert trainer.backend.fingerprint() == done["fingerprint"]  # the weights of step 10
        assert trainer.state.step == 0 and trainer.loader.stream.cursor == 0
        states = trainer.backend.optimizer.state.values()  # fresh: no step taken, zero moments
        assert states and all(s["step"].item() == 0 and not s["exp_avg"].any() for s in states)
        assert built.start.resume is None and built.start.init_from == {
            "path": str(source),
            "source": "checkpoint",
            "backend": "local",
            "source_step": 10,
            "fingerprint": done["fingerprint"],
        }
    finally:
        trainer.callbacks.close()
        built.release()
    bad = micro(f"model.init_from={source}", "model.n_layers=3", out="third")
    with pytest.raises(ConfigError, match="blocks.2.* missing -> "):
        run(bad, ENV)


def test_ckpt_cli_verify_and_inspect(micro):
    cfg = micro("train.max_steps=5", "checkpoint.every=5")
    run(cfg, ENV)
    path = Path(cfg.train.out_dir) / "checkpoints" / "step_00000005"
    ok = run_cli("ckpt", "verify", str(path))
    files = len(json.loads((path / "manifest.json").read_text())["files"])
    assert ok.returncode == 0 and f"{files} files verified" in ok.stdout and files >= 8
    summary = json.loads(run_cli("ckpt", "inspect", str(path)).stdout)
    assert summary["step"] == 5 and summary["bytes"] > 0
    (path / "trainer.json").write_text("{}")
    bad = run_cli("ckpt", "verify", str(path))
    assert bad.returncode == 2 and "trainer.json" in bad.stderr and "Traceback" not in bad.stderr
    assert (path / "dcp" / ".metadata").exists()  # verification never deletes anything


def test_resume_from_an_explicit_bad_path_exits_2(micro_args, tmp_path):
    result = run_cli("train", *micro_args(f"checkpoint.resume={tmp_path / 'nowhere'}"))
    assert result.returncode == 2
    assert "is neither a checkpoint (no manifest.json) nor a run directory" in result.stderr


def test_checkpoint_every_minus_one_writes_none(micro):
    cfg = micro("train.max_steps=4", "checkpoint.every=-1", "train.eval_every=0")
    final = run(cfg, ENV)
    assert final["step"] == 4
    assert not (Path(cfg.train.out_dir) / "checkpoints").exists()


class _Backend:
    """What the manager asks of a backend, recorded; its tensors go through _IO, which writes
    none."""

    def __init__(self, name: str, scale: float | None = None) -> None:
        self.name, self.scale, self.calls = name, scale, []

    def loss_scale(self) -> float | None:
        return self.scale

    def extra_state(self) -> dict:
        return {"engine": {"global_steps": 3}} if self.name == "zero" else {}

    def load_extra_state(self, saved: dict) -> None:
        self.calls.append(("load_extra_state", saved))

    def adopt_loss_scale(self, scale: float) -> None:
        self.calls.append(("adopt_loss_scale", scale))


class _IO:
    """checkpoint/state_io.py's StateIO as the manager calls it: records the loads."""

    def save(self, holder, directory: Path, host_state=None) -> dict:
        return {}

    def load(self, holder, directory: Path, optimizer: bool = True) -> None:
        holder.calls.append("load")


def test_backend_state_goes_back_to_its_backend_and_its_loss_scale_to_another(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2, io=_IO())
    state = {"state": {"step": 3}, "data": {"cursor": 9}}
    path = manager.save(3, _Backend("zero", 512.0), state, {"k": 1}, "train: {}\n")
    same, other = _Backend("zero"), _Backend("local")
    assert manager.load(path, same)["data"] == {"cursor": 9}
    saved = {"backend": "zero", "loss_scale": 512.0, "engine": {"global_steps": 3}}
    assert same.calls == ["load", ("load_extra_state", saved)]
    manager.load(path, other)
    assert other.calls == ["load", ("adopt_loss_scale", 512.0)]


def test_a_checkpoint_of_an_earlier_format_is_refused_naming_convert(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2, io=_IO())
    path = manager.save(3, _Backend("local"), {"data": {}}, {"k": 1}, "train: {}\n")
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps(manifest | {"format_version": 1}))
    backend = _Backend("local")
    with pytest.raises(CheckpointError) as e:
        manager.load(path, backend)
    assert "earlier bigtrain version" in str(e.value)
    assert f"bigtrain ckpt convert {path} NEW_DIR" in str(e.value)
    assert backend.calls == []  # nothing was read


def test_a_rank_resuming_without_rng_state_of_its_own_is_told_the_step(micro):
    """When the world grew, rank 1 gets rank 0's RNG state; its backend is told (the GPT under
    tensor parallelism re-derives its own dropout seed from it)."""
    cfg = micro("train.max_steps=4", "checkpoint.every=4")
    run(cfg, ENV)
    path = Path(cfg.train.out_dir) / "checkpoints" / "step_00000004"

    class Recorder:
        name = "local"

        def __init__(self) -> None:
            self.told: list[int] = []
            self.calls: list = []

        def load_extra_state(self, saved: dict) -> None:
            pass

        def borrowed_rng(self, step: int) -> None:
            self.told.append(step)

    own, borrowing = Recorder(), Recorder()
    CheckpointManager(path.parent, 2, rank=0, world_size=2, io=_IO()).load(path, own)
    CheckpointManager(path.parent, 2, rank=1, world_size=2, io=_IO()).load(path, borrowing)
    assert own.told == [] and borrowing.told == [4]


def test_a_run_directory_means_its_newest_committed_checkpoint_that_verifies(micro, tmp_path):
    from bigtrain.checkpoint.manifest import checkpoint_path

    cfg = micro("train.max_steps=4", "checkpoint.every=2")
    run(cfg, ENV)
    out = Path(cfg.train.out_dir)
    root = out / "checkpoints"
    assert checkpoint_path(out) == root / "step_00000004"
    assert checkpoint_path(root / "step_00000002") == root / "step_00000002"  # as it is
    (root / "step_00000004" / "trainer.json").write_text("{}")  # corrupted: the older one
    assert checkpoint_path(out) == root / "step_00000002"
    (root / "step_00000002" / "trainer.json").write_text("{}")
    with pytest.raises(CheckpointError, match="none of its 2 committed checkpoints verifies"):
        checkpoint_path(out)
    (tmp_path / "empty").mkdir()
    for wrong in (tmp_path / "empty", root, tmp_path / "nowhere"):
        with pytest.raises(CheckpointError) as e:
            checkpoint_path(wrong)
        assert str(e.value) == (
            f"'{wrong}' is neither a checkpoint (no manifest.json) nor a run directory with "
            f"committed checkpoints (no {wrong}/checkpoints/step_*)"
        )


def test_export_ckpt_and_init_from_take_a_run_directory(micro, tmp_path):
    cfg = micro("train.max_steps=3", "checkpoint.every=2", "precision.compute_dtype=fp32")
    done = run(cfg, ENV)
    out = Path(cfg.train.out_dir)
    newest = out / "checkpoints" / "step_00000003"
    verified = run_cli("ckpt", "verify", str(out))
    assert verified.returncode == 0 and f"ok: {newest} " in verified.stdout, verified.stderr
    inspected = run_cli("ckpt", "inspect", str(out))
    assert json.loads(inspected.stdout)["step"] == 3, inspected.stderr
    converted = run_cli("ckpt", "convert", str(out), str(tmp_path / "converted"))
    assert converted.returncode == 0 and "step 3" in converted.stdout, converted.stderr
    exported = run_cli("export", str(out), "--hf", str(tmp_path / "hf"))
    assert exported.returncode == 0, exported.stderr
    assert json.loads(exported.stdout.strip().splitlines()[-1])["step"] == 3
    second = micro(f"model.init_from={out}", "train.max_steps=1", out="second")
    run(second, ENV)
    (event,) = [
        e
        for e in read_jsonl(Path(second.train.out_dir) / "events.jsonl")
        if e["kind"] == "init_from"
    ]
    assert event["source_step"] == 3 and event["fingerprint"] == done["fingerprint"]
    wrong = run_cli("export", str(tmp_path), "--hf", str(tmp_path / "hf2"))
    assert wrong.returncode == 2 and "is neither a checkpoint" in wrong.stderr
    with pytest.raises(ConfigError, match="nor a Hugging Face model directory"):
        run(micro(f"model.init_from={tmp_path}", out="third"), ENV)
