#!/usr/bin/env bash
# The floor's GPU checks (tests/scripts/floor_gpu.py, then test_ddp's NCCL tests) on the floor's torch
# (noxfile.py: FLOOR_TORCH, PyPI's CUDA build), in a venv made here: needs the package index.
# FLOOR_GPU_PYTHON=/path/to/python uses that interpreter (its own torch) instead, and installs nothing.
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${FLOOR_GPU_PYTHON:-}
if [ -z "$python" ]; then
    pin=$(sed -n 's/^FLOOR_TORCH = "\(.*\)"$/\1/p' noxfile.py)
    venv=${FLOOR_GPU_VENV:-/tmp/mpify-nb-floor-gpu}
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q "$pin" -e . pytest pytest-timeout
    python=$venv/bin/python
fi
"$python" -c "import torch; print('torch', torch.__version__, 'GPUs', torch.cuda.device_count())"
status=0
PYTHONPATH=$PWD/src:$PWD/tests timeout -k 10 600 "$python" tests/scripts/floor_gpu.py || status=$?
PYTHONPATH=$PWD/src timeout -k 10 300 "$python" -m pytest -q -p no:cacheprovider tests/test_ddp.py -k nccl || status=$?
exit "$status"
