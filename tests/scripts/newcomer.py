"""A newcomer's walk, timed: from nothing to the quickstart's 2-rank DDP cell, following only the docs.

    python tests/scripts/newcomer.py [--no-cpu-index] [--keep]

In a fresh folder under /tmp: ``git clone`` of this repository (its committed HEAD), the install page's CPU
lines (docs/install.md, "On CPU": the venv, the pip line), ``jupyter lab`` started and asked for its status,
then a kernel of that venv (jupyter_client, as JupyterLab starts one) running the quickstart's cells in order
(docs/quickstart.md) up to its DDP cell on 2 ranks, each cell's output checked against the page. Prints the
time of each step. ``--no-cpu-index`` drops ``--extra-index-url https://download.pytorch.org/whl/cpu`` from the
pip line, for a machine that cannot reach that index but has the CPU wheel at hand (pip's find-links). The
folder is removed at the end (``--keep`` keeps it), and every process it started is ended.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import docblocks  # noqa: E402

CPU_INDEX_OPTION = "--extra-index-url https://download.pytorch.org/whl/cpu"

#: Run by the venv's own Python: a kernel as JupyterLab starts one (its "python3" kernelspec), the cells in
#: order, each cell's output and seconds printed as one JSON line.
KERNEL_SCRIPT = r"""
import json, sys, time
from jupyter_client.manager import start_new_kernel
cells = json.loads(sys.stdin.read())
t0 = time.monotonic()
km, kc = start_new_kernel(kernel_name="python3")
print(json.dumps({"kernel_start_s": time.monotonic() - t0}), flush=True)
try:
    for code in cells:
        t = time.monotonic()
        shown, error = [], None
        def hook(msg):
            global error
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream" and content["name"] == "stdout":
                shown.append(content["text"])
            elif kind in ("execute_result", "display_data"):
                shown.append(content["data"].get("text/plain", "") + "\n")
            elif kind == "error":
                error = f"{content['ename']}: {content['evalue']}"
        reply = kc.execute_interactive(code, timeout=300, output_hook=hook)
        print(json.dumps({"cell": code.splitlines()[0], "seconds": time.monotonic() - t, "shown": "".join(shown),
                          "error": error, "status": reply["content"]["status"]}), flush=True)
finally:
    kc.stop_channels()
    km.shutdown_kernel(now=False)
"""


def _step(name: str, times: list[tuple[str, float]], command: str, cwd: Path) -> None:
    print(f"$ {command}", flush=True)
    start = time.monotonic()
    subprocess.run(command, shell=True, check=True, cwd=cwd, executable="/bin/bash")
    times.append((name, time.monotonic() - start))


def install_lines(no_cpu_index: bool) -> list[str]:
    """The commands of install.md's "On CPU" block, but the last (``jupyter lab``, started below)."""
    text = (ROOT / "docs" / "install.md").read_text()
    section = re.search(r"^## On CPU\n(.*?)(?=^## )", text, re.M | re.S)
    assert section, "docs/install.md has no '## On CPU'"
    block = next(b for b in docblocks.blocks_of(section.group(1), "install.md") if b.lang == "bash")
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in block.code.splitlines()]
    lines = [line for line in lines if line]
    assert lines[-1].startswith(".venv/bin/jupyter lab"), lines
    if no_cpu_index:
        assert CPU_INDEX_OPTION in lines[2], lines[2]
        lines[2] = lines[2].replace(" " + CPU_INDEX_OPTION, "")
    return lines[:-1]


def quickstart_cells() -> list[tuple[str, str | None]]:
    """(code, the output the page shows) of the quickstart's cells, up to its 2-rank DDP cell."""
    found = []
    for block in docblocks.page_blocks(ROOT / "docs" / "quickstart.md"):
        if block.runs:
            found.append((block.code, block.output.code if block.output else None, block.output))
            if "in_torchddp()" in block.code and "ranch(2" in block.code:
                return [(code, out) for code, out, _ in found]
    raise AssertionError("docs/quickstart.md has no 2-rank DDP cell")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-cpu-index", action="store_true")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="mpify_nb_newcomer_"))
    times: list[tuple[str, float]] = []
    lab = None
    try:
        clone, venv, pip_line = install_lines(args.no_cpu_index)
        clone = clone.replace("<URL of this repository>", shlex.quote(str(ROOT)))
        _step("git clone", times, clone, home)
        checkout = home / "mpify_nb"
        _step("python3 -m venv", times, venv, checkout)
        _step("pip install (downloads included)", times, pip_line, checkout)

        # `jupyter lab`, as the page says: it starts and answers
        port = _free_port()
        token = uuid.uuid4().hex
        start = time.monotonic()
        lab = subprocess.Popen([str(checkout / ".venv/bin/jupyter"), "lab", "--no-browser", f"--port={port}",
                                "--ip=127.0.0.1", f"--IdentityProvider.token={token}", "--allow-root"],
                               cwd=checkout, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
        deadline = start + 120
        while True:
            try:
                status = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}",
                                                           timeout=2).read())
                break
            except OSError:
                if time.monotonic() > deadline or lab.poll() is not None:
                    raise RuntimeError("jupyter lab did not start") from None
                time.sleep(0.2)
        times.append(("jupyter lab answers", time.monotonic() - start))
        print(f"jupyter lab is up: {status}")

        cells = quickstart_cells()
        start = time.monotonic()
        ran = subprocess.run([str(checkout / ".venv/bin/python"), "-c", KERNEL_SCRIPT],
                             input=json.dumps([code for code, _ in cells]), capture_output=True, text=True,
                             cwd=checkout, timeout=600)
        if ran.returncode != 0:
            raise RuntimeError(f"the kernel run failed:\n{ran.stderr[-3000:]}")
        lines = [json.loads(line) for line in ran.stdout.splitlines() if line.startswith("{")]
        times.append(("kernel started", lines[0]["kernel_start_s"]))
        for (_code, expected), result in zip(cells, lines[1:]):
            label = f"cell: {result['cell'][:40]}"
            times.append((label, result["seconds"]))
            print(f"--- {result['cell']}\n{result['shown']}", end="")
            if result["error"] or result["status"] != "ok":
                raise RuntimeError(f"{label} failed: {result['error']}")
            if expected is not None and not docblocks.matches(expected, result["shown"], any_order=True):
                raise RuntimeError(f"{label} showed {result['shown']!r}, the page shows {expected!r}")
        times.append(("all quickstart cells, kernel included", time.monotonic() - start))
    finally:
        if lab is not None:
            lab.terminate()
            try:
                lab.wait(30)
            except subprocess.TimeoutExpired:
                lab.kill()
                lab.wait()
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)
    width = max(len(name) for name, _ in times)
    print("\nstep".ljust(width + 1), "seconds")
    for name, seconds in times:
        print(name.ljust(width), f"{seconds:7.1f}")
    print("total".ljust(width), f"{sum(s for n, s in times if not n.startswith(('cell:', 'kernel started'))):7.1f}")
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    os.environ.pop("PYTHONPATH", None)  # the newcomer's venv, not this checkout's src/
    sys.exit(main())
