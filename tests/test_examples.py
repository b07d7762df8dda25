"""The README's demo command runs, and prints what it promises."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_demo_script_runs_and_prints_each_ranks_result():
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "all_reduce results by rank: [[30.0, 2.0], [30.0, 2.0]]" in out, out
    assert "[rank 1] all_reduce on rank 1: [30.0, 2.0]" in out, out
    assert "weights by rank after one DDP step: [0.5, 0.5]" in out, out
