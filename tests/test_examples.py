"""The README's demo command runs, and prints what it promises; the FSDP2 and tensor-parallel notebook
runs and shows what its page says. (The other notebooks: test_notebook.py, test_magics.py,
test_session_magics.py.)"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from versions import needs_fsdp2_on_cpu

ROOT = Path(__file__).resolve().parent.parent


def test_demo_script_runs_and_prints_each_ranks_result():
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "all_reduce results by rank: [[30.0, 2.0], [30.0, 2.0]]" in out, out
    assert "[rank 1] all_reduce on rank 1: [30.0, 2.0]" in out, out
    assert "weights by rank after one DDP step: [0.5, 0.5]" in out, out


# -- examples/fsdp_tp.ipynb: FSDP2 and tensor parallel on a CPU mesh -----------------------------------

@needs_fsdp2_on_cpu
def test_fsdp_and_tensor_parallel_notebook_runs_and_shows_its_shards():
    """The notebook the docs site renders with its outputs: FSDP2 shards, a paused model inspected and
    trained on, a tensor-parallel MLP equal to its unsharded copy, and the same run as one ranch call."""
    nbformat = pytest.importorskip("nbformat")
    import nbutil

    path = ROOT / "examples" / "fsdp_tp.ipynb"
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "commit it with outputs cleared"
    nb.metadata["kernelspec"] = {"name": nbutil.KERNEL_NAME, "display_name": nbutil.KERNEL_NAME, "language": "python"}
    nbutil.execute_notebook(nb, timeout=120, cwd=path.parent)  # raises on any error
    shown = [sorted(nbutil.all_text(c).strip().splitlines()) for c in code]
    by_cell = {c.source.splitlines()[0]: lines for c, lines in zip(code, shown)}

    def cell(start: str) -> list[str]:
        return next(lines for first, lines in by_cell.items() if first.startswith(start))

    assert cell("from torch.distributed.device_mesh") == [
        f"[rank {r}] DTensor (16, 8): this rank holds rows (8, 8)" for r in (0, 1)]
    first = cell("def step")
    assert len(first) == 2 and all(re.fullmatch(r"\[rank [01]\] loss [\d.]+ -> [\d.]+", line) for line in first)
    norm = cell("full = ")
    assert len({line.split("] ")[1] for line in norm}) == 1, norm  # both ranks gathered the same weight
    assert cell("%%local") == [f"(torch.Size([16, 8]), {norm[0].split('] ')[1]})"]
    final = {int(m[1]): m[2] for m in (re.fullmatch(r"\[rank (\d)\] loss after 60 steps: ([\d.]+)", line)
                                       for line in cell("losses +=")) if m}
    assert set(final) == {0, 1}, cell("losses +=")
    assert cell("import copy") == sorted(
        f"[rank {r}] layer {name}: Shard(dim={dim}), this rank holds {local} of {whole}"
        for r in (0, 1) for name, dim, local, whole in (("0", 0, "(16, 8)", "(32, 8)"), ("2", 1, "(8, 16)", "(8, 32)")))
    assert cell("x = torch.randn") == ["[rank 0] ((4, 8), True)", "[rank 1] ((4, 8), True)"]
    # One ranch call with the same seeds and steps ends with the session's losses.
    assert cell("from mpify_nb import in_torchddp, ranch") == [f"[{final[0]}, {final[1]}]"]
    nbutil.keep_executed_example(path, nb)  # the docs build renders it (no second run)
