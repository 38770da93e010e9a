"""Writes the format-1 checkpoints in this directory. Run from a checkout of a bigtrain version
before the one DCP format (they were made at commit 988d144):

    cd OLD_CHECKOUT && python /path/to/tests/checkpoint/legacy/make.py /path/to/tests/checkpoint/legacy

For each backend (local; fsdp and zero-2 on 2 ranks) a micro GPT trains 6 steps on the test
corpus with a checkpoint at step 3; `expected.json` keeps each run's fingerprint at step 6 and
its losses, and `final_<backend>.safetensors` its FP32 weights at step 6 (that version's
`ckpt convert --to local` of its step-6 checkpoint), which a converted step-3 checkpoint must
reproduce when resumed, within the tolerance tests/checkpoint/test_convert.py justifies.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, ".")

from bigtrain.config import load_config  # noqa: E402
from bigtrain.parallel.env import read_env  # noqa: E402
from bigtrain.runner import run  # noqa: E402
from bigtrain.store.rundir import read_jsonl  # noqa: E402
from tests.conftest import micro_overrides, shakespeare_files, strip_play_markup  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

SMALL = ["model.n_layers=1", "model.d_model=32", "train.global_batch_size=16", "train.max_steps=6"]
SMALL += ["checkpoint.every=3", "checkpoint.keep=5", "checkpoint.async_save=false"]
SMALL += ["train.log_every=1", "train.eval_every=0", "precision.compute_dtype=fp32"]
BACKENDS = {
    "local": ["parallel.backend=local"],
    "fsdp": ["parallel.backend=fsdp"],
    "zero2": ["parallel.backend=zero", "parallel.zero_stage=2"],
}


def train(overrides: list[str]) -> dict:
    cfg = load_config([], overrides)
    final = run(cfg, read_env())
    metrics = read_jsonl(Path(cfg.train.out_dir) / "metrics.jsonl")
    return {
        "fingerprint": final["fingerprint"],
        "losses": {m["step"]: m["loss"] for m in metrics if "loss" in m},
    }


def main(dest: Path) -> None:
    tmp = Path(tempfile.mkdtemp())
    corpus = tmp / "corpus"
    corpus.mkdir()
    files = []
    for src in shakespeare_files()[:2]:
        files.append(corpus / (src.stem + ".txt"))
        files[-1].write_text(strip_play_markup(src.read_text()))
    expected = {}
    for name, extra in BACKENDS.items():
        args = [*micro_overrides(tmp / name, files, tmp / "cache"), *SMALL, *extra]
        result = train(args) if name == "local" else run_distributed(train, 2, args)[0]
        expected[name] = result
        checkpoints = tmp / name / "checkpoints"
        shutil.copytree(checkpoints / "step_00000003", dest / name)
        whole = tmp / f"{name}-step6-local"
        convert = ["ckpt", "convert", str(checkpoints / "step_00000006"), "--to", "local"]
        subprocess.run([sys.executable, "-m", "bigtrain", *convert, str(whole)], check=True)
        shutil.copy(whole / "model.safetensors", dest / f"final_{name}.safetensors")
    (dest / "expected.json").write_text(json.dumps(expected, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
