"""Run code cells in a real Jupyter kernel (ipykernel, driven by nbclient) and read what they printed.

The kernel is this interpreter (``sys.executable``, i.e. the project's venv), through a
kernelspec written to a private directory, so a ``python3`` kernelspec elsewhere on the
machine can never be picked up instead.

Every kernel started here carries a unique marker in its environment. The environment is
inherited by everything the kernel starts (the template, the ranks), so after the kernel
is shut down, :func:`leftover_processes` finds any process it left behind, exactly,
without matching processes by name.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Optional, Union

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbformat import NotebookNode
from traitlets import default

KERNEL_NAME = "mpify-nb-test"
#: Environment variable whose value identifies the processes of one test kernel.
MARKER_VAR = "MPIFY_NB_TEST_KERNEL"
REPO_ROOT = Path(__file__).resolve().parent.parent

_kernel_dir: Optional[str] = None


def kernel_dir() -> str:
    """A directory holding one kernelspec, ``mpify-nb-test``, that runs this very interpreter."""
    global _kernel_dir
    if _kernel_dir is None:
        root = tempfile.mkdtemp(prefix="mpify_nb_kernels_")
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        spec_dir = os.path.join(root, KERNEL_NAME)
        os.mkdir(spec_dir)
        spec = {
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "mpify_nb tests (venv python)",
            "language": "python",
            "metadata": {"debugger": False},
        }
        with open(os.path.join(spec_dir, "kernel.json"), "w") as f:
            json.dump(spec, f)
        _kernel_dir = root
    return _kernel_dir


class VenvKernelManager(AsyncKernelManager):
    """A kernel manager that only knows the private kernelspec of :func:`kernel_dir`."""

    @default("kernel_spec_manager")
    def _default_ksm(self) -> KernelSpecManager:
        return KernelSpecManager(kernel_dirs=[kernel_dir()], ensure_native_kernel=False)


def new_notebook(cells: list[str]) -> NotebookNode:
    """A notebook with one code cell per source string."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": KERNEL_NAME, "language": "python"}
    return nb


class StackTellingClient(NotebookClient):
    """A client that, when a cell times out, takes the Python stacks of every process of its
    kernel (the kernel, the template, the ranks, their children) before the kernel is shut
    down: a hang seen once in CI then says where each process waited."""

    def __init__(self, nb: NotebookNode, marker: str, **kw: Any) -> None:
        super().__init__(nb, **kw)
        self.marker = marker
        self.stacks = ""

    async def _async_handle_timeout(self, timeout: int, cell: Optional[NotebookNode] = None) -> Any:
        self.stacks = process_stacks(self.marker)
        return await super()._async_handle_timeout(timeout, cell)

    def note_stacks(self, error: BaseException) -> None:
        """Add the stacks taken at a timeout, if any, to ``error`` (the one the timeout raised)."""
        if self.stacks and hasattr(error, "add_note"):
            error.add_note(self.stacks)


def process_stacks(marker: str, each_timeout: float = 20.0) -> str:
    """The Python stacks (``py-spy dump``, every thread) of the live processes tagged ``marker``,
    as one text; a line saying why when py-spy is not installed or cannot attach."""
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if py_spy is None:
        return "(no process stacks: py-spy is not installed)"
    parts = []
    for pid in leftover_processes(marker):
        try:
            done = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                                  timeout=each_timeout)
            stacks = done.stdout.strip() or done.stderr.strip()
        except (OSError, subprocess.TimeoutExpired) as error:
            stacks = f"py-spy failed: {error}"
        parts.append(f"---- process {pid}: {_cmdline(pid)}\n{stacks}")
    return "stacks of the kernel's processes at the timeout:\n" + "\n".join(parts)


def execute_notebook(
    nb: NotebookNode,
    timeout: float = 120,
    allow_errors: bool = False,
    cwd: Union[str, Path, None] = None,
    env: Optional[dict[str, str]] = None,
) -> NotebookNode:
    """Execute ``nb`` in place in a fresh kernel, shut down afterwards whatever happens.

    Raises ``nbclient.exceptions.CellExecutionError`` on the first failing cell unless
    ``allow_errors``, ``nbclient.exceptions.CellTimeoutError`` when a cell runs past
    ``timeout`` seconds, and ``AssertionError`` when the kernel left a process running.
    """
    marker = uuid.uuid4().hex
    kernel_env = dict(os.environ if env is None else env)
    kernel_env[MARKER_VAR] = marker
    kernel_env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # quiets a debugger warning on stderr
    client = StackTellingClient(
        nb,
        marker=marker,
        timeout=timeout,
        allow_errors=allow_errors,
        kernel_name=KERNEL_NAME,
        kernel_manager_class=VenvKernelManager,
        shutdown_kernel="graceful",
        resources={"metadata": {"path": str(cwd or REPO_ROOT)}},
    )
    try:
        # The client owns its kernel manager, so execute() shuts the kernel down on the way out.
        client.execute(env=kernel_env)
    except BaseException as error:
        client.note_stacks(error)
        kill_leftovers(marker)  # the cell's error is the news; don't let a leak hide it
        raise
    assert_no_leftovers(marker)
    return nb


def run_cells(
    cells: list[str],
    timeout: float = 120,
    allow_errors: bool = False,
    cwd: Union[str, Path, None] = None,
    env: Optional[dict[str, str]] = None,
) -> list[NotebookNode]:
    """Run ``cells`` (source strings) in order in a fresh kernel; return the executed cells. ``env``:
    variables set in the kernel's environment (this process's, with them)."""
    kernel_env = dict(os.environ, **env) if env else None
    return execute_notebook(new_notebook(cells), timeout=timeout, allow_errors=allow_errors, cwd=cwd,
                            env=kernel_env).cells


def keep_executed_example(source: Union[str, Path], nb: NotebookNode) -> None:
    """Leave ``nb``, the example notebook ``source`` as a test executed it (its checks passed), for the
    docs build to render rather than run again: ``$MPIFY_NB_EXECUTED_EXAMPLES/<sha256 of the source
    file>.ipynb`` (mkdocs_hooks.py). Nothing when that variable is unset (it is set by .ci/run)."""
    folder = os.environ.get("MPIFY_NB_EXECUTED_EXAMPLES")
    if not folder:
        return
    digest = hashlib.sha256(Path(source).read_bytes()).hexdigest()
    os.makedirs(folder, exist_ok=True)
    nbformat.write(nb, os.path.join(folder, f"{digest}.ipynb"))


# -- reading outputs ---------------------------------------------------------------------

def stream_text(cell: NotebookNode, name: str = "stdout") -> str:
    """All text the cell wrote to ``name`` ("stdout" or "stderr"), in order."""
    return "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == name)


def all_text(cell: NotebookNode) -> str:
    """Everything visible in the cell's outputs as text: streams, results, errors."""
    parts: list[str] = []
    for o in cell.get("outputs", []):
        kind = o.get("output_type")
        if kind == "stream":
            parts.append(o.get("text", ""))
        elif kind in ("execute_result", "display_data"):
            parts.append(o.get("data", {}).get("text/plain", "") + "\n")
        elif kind == "error":
            parts.append(error_text(o))
    return "".join(parts)


def errors(cell: NotebookNode) -> list[NotebookNode]:
    """The cell's error outputs (``ename``, ``evalue``, ``traceback``)."""
    return [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]


def error_text(error: Any) -> str:
    """An error output's (or CellExecutionError's) traceback as plain text, ANSI colours removed."""
    lines = error.get("traceback", []) if isinstance(error, dict) else getattr(error, "traceback", "")
    text = "\n".join(lines) if isinstance(lines, list) else str(lines)
    return strip_ansi(text)


def strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)


def result_text(cell: NotebookNode) -> str:
    """The ``text/plain`` of the cell's ``execute_result`` (its last expression), or ''."""
    for o in cell.get("outputs", []):
        if o.get("output_type") == "execute_result":
            return o.get("data", {}).get("text/plain", "")
    return ""


# -- leftover processes ------------------------------------------------------------------

def leftover_processes(marker: str) -> list[int]:
    """PIDs of live processes whose environment carries ``MARKER_VAR=marker``."""
    needle = f"{MARKER_VAR}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue  # gone, or not ours
        if state != b"Z" and needle in environ.split(b"\0"):
            found.append(int(entry))
    return found


def assert_no_leftovers(marker: str, grace: float = 10.0) -> None:
    """Fail if a process of the kernel tagged ``marker`` is still alive ``grace`` seconds on.

    Those processes are killed first (by PID; they are ours), so one failure does not
    leave the machine busy for the tests that follow.
    """
    deadline = time.monotonic() + grace
    pids = leftover_processes(marker)
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = leftover_processes(marker)
    if pids:
        described = kill_leftovers(marker)
        raise AssertionError(f"the kernel left processes running (now killed): {described}")


def kill_leftovers(marker: str) -> dict[int, str]:
    """SIGKILL the live processes tagged ``marker``; return ``{pid: command line}`` of those."""
    described = {}
    for pid in leftover_processes(marker):
        described[pid] = _cmdline(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return described


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


# -- a kernel shared by a test module ---------------------------------------------------

class SharedKernel:
    """A test module's kernel, shared by its tests, that one failed test does not break for the
    tests after it (a rank left stuck in a collective or dead, a cell still running when a
    timeout ended the test): after a test that failed, conftest.py calls :meth:`recover`, which
    ends this kernel (and kills what it left, by its marker) and makes a fresh one. One failure
    shows as one failure.

    ``make()`` returns a ready kernel driver (its setup cells run); everything else is read from
    the driver itself (``shared.ok(...)`` is ``driver.ok(...)``)."""

    def __init__(self, make: Any) -> None:
        self._make = make
        self._driver = make()
        self.recoveries = 0

    def __getattr__(self, name: str) -> Any:
        driver = self.__dict__.get("_driver")
        if driver is None:
            raise AttributeError(name)
        return getattr(driver, name)

    def recover(self) -> None:
        """Replace the kernel by a fresh one, ending the old one whatever its state."""
        old, self._driver = self._driver, None
        try:
            old.close()
        except BaseException as e:  # a stuck kernel's leftovers are killed on the way
            print(f"[SharedKernel] the failed test's kernel did not close cleanly: {e!r}", file=sys.stderr)
        marker = getattr(old, "marker", None)
        if marker is not None:
            kill_leftovers(marker)
        self._driver = self._make()
        self.recoveries += 1

    def close(self) -> None:
        if self._driver is not None:
            self._driver.close()


def shared_kernel(make: Any) -> Any:
    """A module fixture's body: ``yield from shared_kernel(make)`` yields a :class:`SharedKernel`
    and closes it at the module's end."""
    shared = SharedKernel(make)
    try:
        yield shared
    finally:
        shared.close()


def ready(driver: Any, run: str, cells: list[str]) -> Any:
    """``driver`` after running ``cells`` with its method ``run`` (``"ok"``, ``"good"``, ``"cell"``);
    closed if one fails."""
    try:
        for cell in cells:
            getattr(driver, run)(cell)
    except BaseException:
        driver.close()
        raise
    return driver


# -- a reference run under torchrun -------------------------------------------------------------

def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children first), whatever session or group they are in."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def torchrun_results(script, *args: str, timeout: float = 120) -> list[dict]:
    """Run ``torchrun --nproc-per-node 2 script args...`` (a free port, torchrun's own thread rule)
    and return each rank's ``RESULT {...}`` line (a flat JSON object with a "rank"), by rank."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("OMP_NUM_THREADS", None)  # torchrun's own rule decides, as in ranch
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
         str(script), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            # torchrun starts each worker in a session of its own: killing torchrun's group alone left
            # them running for the rest of the suite (seen after a timeout under load).
            for pid in [*_descendants(proc.pid), proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
    # The two workers share one stdout: their lines may run into each other.
    results = [json.loads(m) for m in re.findall(r"RESULT (\{[^{}]*\})", out)]
    # torch itself may abort a worker at exit, after its results ("terminate called without an active
    # exception": a gloo thread outliving a group, issue 38; ranch ends such calls cleanly): the
    # baseline's numbers stand; any other failure, or a missing result, does not.
    crashed_at_exit = "terminate called without an active exception" in err and len(results) == 2
    assert proc.returncode == 0 or crashed_at_exit, err[-3000:]
    assert len(results) == 2, out
    return sorted(results, key=lambda r: r["rank"])

