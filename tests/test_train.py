import json
import math
from pathlib import Path

import pytest

from bigtrain.config.schema import OptimConfig
from bigtrain.errors import AbortRun
from bigtrain.parallel.env import DistEnv
from bigtrain.runner import run
from bigtrain.store.rundir import read_jsonl
from bigtrain.train import lr_at
from tests.conftest import run_cli, slow_writer_env

ENV = DistEnv()


@pytest.mark.unit
def test_lr_schedule_by_hand():
    cfg = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    assert lr_at(0, 110, cfg) == pytest.approx(0.1)
    assert lr_at(9, 110, cfg) == pytest.approx(1.0)
    assert lr_at(60, 110, cfg) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, 110, cfg) == pytest.approx(0.1)
    linear = OptimConfig(lr=1.0, warmup_steps=0, min_lr_ratio=0.0, schedule="linear")
    assert lr_at(25, 100, linear) == pytest.approx(0.75)


@pytest.mark.e2e
def test_short_run_loss_falls_and_writes_the_run_directory(micro):
    cfg = micro("train.max_steps=30", "optim.lr=1e-2")
    final = run(cfg, ENV)
    out = cfg.train.out_dir
    metrics = read_jsonl(Path(out) / "metrics.jsonl")
    train = [m for m in metrics if "loss" in m]
    assert train[0]["step"] == 5 and train[-1]["step"] == 30
    assert train[-1]["loss"] < train[0]["loss"] - 0.3
    vals = [m["val_loss"] for m in metrics if "val_loss" in m]
    assert len(vals) == 4  # before training, steps 10, 20, 30
    assert vals[-1] < vals[0] - 0.8
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "samples_seen"):
        assert key in train[-1], key
    assert train[-1]["samples_seen"] == 30 * 8
    events = read_jsonl(Path(out) / "events.jsonl")
    # A healthy run's suspicions (a replayed step each) are the data's, never transient.
    suspicions = [e for e in events if e["kind"] == "suspicion"]
    assert all(e["verdict"] == "reproduced" for e in suspicions)
    kinds = [e["kind"] for e in events if e["kind"] != "suspicion"]
    # startup's costs after the first step; steps 10 and 20 are written in the background and
    # committed at a later step; 30 (the last) synchronously; the process's costs before finish
    background = ["checkpoint_started", "checkpoint"] * 2
    assert kinds == ["start", "startup", *background, "checkpoint", "costs", "finish"]
    committed = [e["path"][-13:] for e in events if e["kind"] == "checkpoint"]
    assert committed == ["step_00000010", "step_00000020", "step_00000030"]
    saved = json.loads((Path(out) / "final.json").read_text())
    assert saved == final
    assert (
        saved["loss"] == train[-1]["loss"]
        and saved["step"] == 30
        and saved["tokens"] == 30 * 8 * 32
    )
    assert len(saved["fingerprint"]) == 64


@pytest.mark.e2e
def test_precision_policy_is_in_the_start_event(micro):
    cfg = micro("train.max_steps=1", "precision.compute_dtype=fp32")
    run(cfg, ENV)
    start = read_jsonl(Path(cfg.train.out_dir) / "events.jsonl")[0]
    assert start["precision"]["compute"] == {
        "choice": "fp32",
        "reason": "precision.compute_dtype=fp32",
    }


@pytest.mark.e2e
def test_gradient_accumulation_matches_a_larger_micro_batch(micro):
    """Same global batch (16) as 2 x 8 or 1 x 16: same samples, same mean loss, same weights (FP32)."""
    a = run(
        micro(
            "train.max_steps=4",
            "precision.compute_dtype=fp32",
            "train.micro_batch_size=8",
            "train.grad_accum_steps=2",
            out="a",
        ),
        ENV,
    )
    b = run(
        micro(
            "train.max_steps=4",
            "precision.compute_dtype=fp32",
            "train.micro_batch_size=16",
            out="b",
        ),
        ENV,
    )
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


@pytest.mark.e2e
def test_resume_is_bit_exact(micro):
    straight = run(micro("train.max_steps=40", out="straight"), ENV)
    first = run(
        micro("train.max_steps=40", "train.stop_at_step=20", out="resumed"),
        ENV,
    )
    assert first == {"step": 20, "stopped": True}
    resumed = run(micro("train.max_steps=40", out="resumed"), ENV)
    assert resumed["fingerprint"] == straight["fingerprint"]
    assert resumed["loss"] == straight["loss"]
    assert resumed["samples"] == straight["samples"]
    events = read_jsonl(Path(micro().train.out_dir).parent / "resumed" / "events.jsonl")
    resume = [e for e in events if e["kind"] == "resume"]
    assert (
        len(resume) == 1 and resume[0]["step"] == 20 and resume[0]["path"].endswith("step_00000020")
    )


@pytest.mark.e2e
def test_nonfinite_skip_counts_and_goes_on(micro):
    cfg = micro("train.max_steps=6", "monitor.nonfinite=skip", "drill.nan_grad_step=[3]")
    final = run(cfg, ENV)
    assert final["skipped_steps"] == 1 and final["anomalies"] == 1
    assert math.isfinite(final["loss"])
    events = read_jsonl(Path(cfg.train.out_dir) / "events.jsonl")
    anomaly = [e for e in events if e["kind"] == "anomaly"]
    assert len(anomaly) == 1 and anomaly[0]["step"] == 3 and anomaly[0]["metric"] == "grads"
    fault = next(e for e in events if e["kind"] == "fault")
    assert anomaly[0]["tensor"] == fault["tensor"] and anomaly[0]["action"] == "skip"
    assert anomaly[0]["top_nonfinite"] == [[fault["tensor"], 1]]


@pytest.mark.e2e
def test_nonfinite_abort_exits_3_and_stays_aborted(micro_args, tmp_path):
    args = micro_args(
        "train.max_steps=12",
        "checkpoint.every=5",
        "drill.nan_loss_step=[7]",
        "monitor.nonfinite=abort",
    )
    # The step-5 checkpoint's background write stalls 5 s: it is still in flight at the abort.
    result = run_cli("train", *args, env=slow_writer_env(tmp_path, 5))
    assert result.returncode == 3, result.stderr
    assert "non-finite loss at step 7" in result.stderr
    out = tmp_path / "run"
    assert (out / "ABORTED").is_file()
    assert [p.name for p in (out / "checkpoints").iterdir()] == [
        "step_00000005"
    ]  # none after the anomaly
    kinds = [e["kind"] for e in read_jsonl(out / "events.jsonl")]
    # the step-5 checkpoint, still being written in the background, is committed on the way out
    assert kinds[-4:] == ["anomaly", "abort", "checkpoint", "costs"]  # then the process's costs
    assert "checkpoint" not in kinds[:-2]
    assert not (out / "final.json").exists()
    again = run_cli("train", *args)
    assert again.returncode == 3 and "ABORTED exists" in again.stderr


@pytest.mark.e2e
def test_per_layer_telemetry_at_log_steps(micro):
    cfg = micro("train.max_steps=6", "train.log_every=3", "monitor.every=0")
    run(cfg, ENV)
    records = [r for r in read_jsonl(Path(cfg.train.out_dir) / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [3, 6]
    for record in records:
        layers = list(record["layer_grad_norm"])
        assert layers[0] == "tok_emb" and "blocks.0" in layers and "blocks.1" in layers
        assert list(record["layer_grad_max"]) == layers and record["grad_nonfinite"] == 0
        # The global norm is the root of the summed per-layer squares; max |g| <= a layer's norm.
        total = math.sqrt(sum(v * v for v in record["layer_grad_norm"].values()))
        assert record["grad_norm"] == pytest.approx(total, rel=1e-5)
        for layer in layers:
            assert record["layer_grad_max"][layer] <= record["layer_grad_norm"][layer] * (1 + 1e-6)


@pytest.mark.e2e
def test_a_gross_gradient_spike_is_skipped_and_names_the_tensor(micro):
    """One tensor's gradient x 10^5 (gross corruption, the grad_norm rule's case): skipped, and
    the report names the tensor by its jump over its own history and by max |g|."""
    cfg = micro(
        "train.max_steps=30",
        "monitor.on_spike=skip",
        "drill.data_spike_step=[25]",  # in the replay too: not transient
        "drill.spike_factor=1e5",
        "drill.grad_tensor=blocks.1.mlp.up.weight",
    )
    final = run(cfg, ENV)
    events = read_jsonl(Path(cfg.train.out_dir) / "events.jsonl")
    anomaly = [e for e in events if e["kind"] == "anomaly"]
    assert [e["step"] for e in anomaly] == [25] and final["skipped_steps"] == 1
    assert anomaly[0]["type"] == "spike" and anomaly[0]["action"] == "skip"
    assert anomaly[0]["metric"] == "grad_norm" and anomaly[0]["tensor"] == "blocks.1.mlp.up.weight"
    assert anomaly[0]["top_jumps"][0][0] == "blocks.1.mlp.up.weight"
    assert anomaly[0]["top_jumps"][0][1] > 1e4
    assert anomaly[0]["top_max_abs"][0][0] == "blocks.1.mlp.up.weight"


@pytest.mark.e2e
def test_anomalies_in_a_row_stop_the_run(micro):
    cfg = micro(
        "train.max_steps=10",
        "monitor.nonfinite=skip",
        "monitor.max_consecutive=3",
        "drill.nan_grad_step=[4,5,6,7]",
    )
    with pytest.raises(AbortRun, match="3 anomalous steps in a row up to step 6"):
        run(cfg, ENV)


@pytest.mark.e2e
def test_resume_never_refuses_a_directory_with_checkpoints(micro):
    run(micro("train.max_steps=10"), ENV)
    from bigtrain.errors import ConfigError

    with pytest.raises(ConfigError, match="checkpoint.resume=never but"):
        run(micro("train.max_steps=10", "checkpoint.resume=never"), ENV)


@pytest.mark.e2e
def test_aborted_marker_blocks_a_restart(micro):
    cfg = micro("train.max_steps=2")
    out = Path(cfg.train.out_dir)
    out.mkdir(parents=True)
    (out / "ABORTED").write_text("earlier anomaly\n")
    with pytest.raises(AbortRun, match="earlier anomaly"):
        run(cfg, ENV)


@pytest.mark.e2e
def test_skipped_bad_rows_reach_the_run_as_an_event(micro, corpus_files, tmp_path):
    rows = [{"text": line} for line in corpus_files[0].read_text().splitlines() if line.strip()]
    rows[3], rows[7] = {"title": "no text"}, {"text": None}
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = micro(
        f"data.paths=[{data}]",
        "data.skip_bad_rows=true",
        f"data.cache_dir={tmp_path / 'cache'}",
        "train.max_steps=2",
        "checkpoint.every=-1",
    )
    run(cfg, ENV)
    events = read_jsonl(Path(cfg.train.out_dir) / "events.jsonl")
    (skipped,) = [e for e in events if e["kind"] == "data_skipped_rows"]
    assert skipped["files"] == {str(data.resolve()): 2} and skipped["rows"] == 2


@pytest.mark.e2e
def test_every_checkpoint_holds_the_loss_of_its_own_step(micro):
    """The loop records each step's loss at the step's one host read: a checkpoint written
    before that step's metrics line (or at a step without one) holds it, not an older one."""
    cfg = micro("train.max_steps=7", "train.log_every=1", "checkpoint.every=3", "checkpoint.keep=5")
    final = run(cfg, ENV)
    out = Path(cfg.train.out_dir)
    logged = {m["step"]: m["loss"] for m in read_jsonl(out / "metrics.jsonl") if "loss" in m}
    for step in (3, 6, 7):
        saved = json.loads((out / f"checkpoints/step_{step:08d}/trainer.json").read_text())
        assert saved["state"]["last_loss"] == logged[step], step
    assert final["loss"] == logged[7]


@pytest.mark.e2e
def test_a_finished_run_started_again_says_so_and_keeps_final_json(micro, micro_args):
    cfg = micro("train.max_steps=4", "train.log_every=3", "checkpoint.every=2")
    run(cfg, ENV)
    final_json = Path(cfg.train.out_dir) / "final.json"
    before, mtime = final_json.read_text(), final_json.stat().st_mtime_ns
    again = run_cli(
        "train", *micro_args("train.max_steps=4", "train.log_every=3", "checkpoint.every=2")
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert "already finished at step 4" in again.stdout
    assert final_json.read_text() == before and final_json.stat().st_mtime_ns == mtime
    assert json.loads(again.stdout.strip().splitlines()[-1]) == json.loads(before)
    # without final.json (lost after the last checkpoint): written again with the true values
    final_json.unlink()
    # this process's, not the run's; the costs the run's processes measured are not in a checkpoint
    measured = {"wall_s": 0, "peak_memory_bytes_by_rank": 0, "costs": None}
    assert run(cfg, ENV) | measured == json.loads(before) | measured
