"""Which torch has what: every check of the installed torch's version or features, in one place.

mpify_nb supports torch from :data:`FLOOR` on (pyproject.toml says the same; the floor's CI job,
``nox -s floor``, runs the version-sensitive tests on it). What differs between the floor and
today's torch, and what mpify_nb does about it:

=====================================  ==========  ==============================================
what                                   torch       here
=====================================  ==========  ==============================================
gloo's flight recorder                 2.8         :func:`has_gloo_recorder`; before, the collective
                                                   watch reads the stack (torchdist/hidden_waits.py),
                                                   and cannot tell mismatched collectives apart
                                                   (:func:`gloo_records_collectives`)
the recorder's variable                2.8         :func:`recorder_variable`
TCPStore(master_listen_fd=) on libuv   2.8         :func:`listen_fd_store_options` (legacy store)
a gloo group destroyed without a       2.8         :func:`destroy_process_group` (releases the GIL)
  deadlock
``_abort_process_group``               2.6         :func:`abort_process_group`
``FSDPModule`` in torch.distributed    2.6         :func:`fsdp_module_type` (2.4: _composable.fsdp)
  .fsdp
public DTensor (torch.distributed      2.5         :func:`dtensor_type` (2.4: torch.distributed._tensor)
  .tensor)
DeviceMesh ``_dim_group_names``        2.8         :func:`mesh_group_names_attribute`
                                                   (before: ``_dim_group_infos``)
gloo's "[Gloo] Rank N is connected"    2.8-2.12    :func:`gloo_prints_banner`
  line on stdout
init_process_group's "[rankN]: "       all         :func:`without_rank_excepthooks` (the caller's
  sys.excepthook                                   rank, a persistent rank after each request)
c10's log level, set while running     all         :func:`quiet_cpp_warnings` (``FLAGS_caffe2_log_level``
                                                   in libc10; nothing where it is missing)
=====================================  ==========  ==============================================

torch is never imported here at module level: the caller may not have imported it yet.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
from typing import Any, Callable, Optional

#: The oldest torch mpify_nb supports (pyproject.toml: ``torch>=2.4``).
FLOOR = (2, 4)


def parse_version(text: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: ``"2.4.1+cu121"`` -> (2, 4), ``"2.9.0a0+git"`` -> (2, 9)."""
    parts = re.findall(r"\d+", text)[:2]
    if len(parts) < 2:
        raise ValueError(f"not a torch version: {text!r}")
    return int(parts[0]), int(parts[1])


def torch_version() -> tuple[int, int]:
    """(major, minor) of the torch this process runs (imported here if it is not yet)."""
    torch = sys.modules.get("torch")
    if torch is None:
        import torch
    return parse_version(str(torch.__version__))


def installed_torch_version() -> Optional[str]:
    """The torch version installed for this interpreter, without importing torch (that takes
    seconds): the imported one's if torch is imported, else the package metadata's; None when
    neither says."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return str(getattr(torch, "__version__", "")) or None
    try:
        from importlib import metadata

        return metadata.version("torch")
    except Exception:
        return None


def check_floor(version: Optional[str] = None) -> None:
    """Fail at once, naming both versions, when the installed torch is older than :data:`FLOOR`
    (pip keeps it out, but ``--no-deps``, conda or a container's own torch do not)."""
    version = installed_torch_version() if version is None else version
    if version is None:
        return  # no torch at all, or one without metadata: importing it will say
    try:
        found = parse_version(version)
    except ValueError:
        return
    if found < FLOOR:
        raise ImportError(
            f"mpify_nb needs torch >= {FLOOR[0]}.{FLOOR[1]}, and this environment has torch {version}: "
            f"install a newer torch (pip install 'torch>={FLOOR[0]}.{FLOOR[1]}'). The docs' install page "
            "lists which feature needs which torch.")


@functools.cache
def has_gloo_recorder() -> bool:
    """Does torch's flight recorder record gloo's collectives (torch >= 2.8, which added
    ``_dump_fr_trace``)? Before, only NCCL's are recorded: a gloo collective a rank waits on
    is seen on its stack only (torchdist/hidden_waits.py)."""
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return False
    return hasattr(c10d, "_dump_fr_trace")


def gloo_records_collectives() -> bool:
    """:func:`has_gloo_recorder` by the installed version, without importing torch (a notebook
    that drives ranks may not have imported it): True where the version is unknown."""
    version = installed_torch_version()
    try:
        return version is None or parse_version(version) >= (2, 8)
    except ValueError:
        return True


def recorder_variable() -> str:
    """The environment variable that sizes the flight recorder: ``TORCH_FR_BUFFER_SIZE`` since
    torch 2.8 (gloo's and NCCL's), ``TORCH_NCCL_TRACE_BUFFER_SIZE`` (NCCL's only) before."""
    # The installed version: a call made before the notebook imported torch need not import it (seconds).
    version = installed_torch_version()
    try:
        found = torch_version() if version is None else parse_version(version)
    except ValueError:
        found = torch_version()
    return "TORCH_FR_BUFFER_SIZE" if found >= (2, 8) else "TORCH_NCCL_TRACE_BUFFER_SIZE"


def listen_fd_store_options() -> dict[str, Any]:
    """Keyword arguments for a ``TCPStore(..., master_listen_fd=fd)``: before torch 2.8 the libuv
    store (the default since 2.4) refuses a listening socket ("The libuv TCPStore backend does not
    support initialization with an listen fd"), and only ``use_libuv=False`` avoids it (the
    ``USE_LIBUV=0`` variable is read by the env:// rendezvous, not by TCPStore itself)."""
    return {"use_libuv": False} if torch_version() < (2, 8) else {}


def _backends_of(groups: list) -> list:
    """The Python objects of the backends (ProcessGroupGloo, ProcessGroupNCCL, ...) of ``groups``."""
    import torch

    found = []
    for group in groups:
        for device in ("cpu", "cuda"):
            try:
                found.append(group._get_backend(torch.device(device)))
            except Exception:
                continue  # no backend for that device
    return found


def destroy_process_group(group: Any = None) -> None:
    """``torch.distributed.destroy_process_group(group)`` that cannot deadlock on torch < 2.8.

    There a gloo group's destructor joins its worker threads while holding the GIL, and a worker
    that is just destroying a finished collective needs the GIL to free a tensor's Python object:
    both wait for ever (seen with py-spy: ``~ProcessGroupGloo -> thread::join`` against
    ``AsyncWork::~AsyncWork -> PyObjectSlot::maybe_destroy_pyobj -> gil_scoped_acquire``; torch 2.8
    releases the GIL in ProcessGroup's destructor, pytorch/pytorch#154976). The backends' own Python
    classes release the GIL before their C++ destructor runs: holding their Python objects across
    ``destroy_process_group`` makes them the last references, and dropping them here destroys
    each backend with the GIL released, so its workers finish and the join returns."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if group is None:
        groups = list(distributed_c10d._world.pg_map)
    else:
        groups = [group]
    backends = _backends_of(groups)
    del groups
    try:
        dist.destroy_process_group(group)
    finally:
        while backends:
            backends.pop()  # the last reference: destroyed now, with the GIL released


def abort_process_group() -> None:
    """Abort every process group of this process (NCCL communicators included), to unstick a
    collective: ``_abort_process_group`` where torch has it (2.6+); before, destroying the
    groups shuts their backends down (``_shutdown_backend``, which aborts NCCL's communicators)."""
    from torch.distributed import distributed_c10d

    abort = getattr(distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        abort()
    else:
        destroy_process_group()


def fsdp_module_type() -> Optional[type]:
    """FSDP2's module class (what ``fully_shard`` makes) when the process imported FSDP2, else
    None: ``torch.distributed.fsdp.FSDPModule`` since torch 2.6, in
    ``torch.distributed._composable.fsdp`` before."""
    for name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        found = getattr(sys.modules.get(name), "FSDPModule", None)
        if isinstance(found, type):
            return found
    return None


def dtensor_type() -> Optional[type]:
    """The DTensor class when the process imported it, else None: public in
    ``torch.distributed.tensor`` since torch 2.5, ``torch.distributed._tensor`` before."""
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
        found = getattr(sys.modules.get(name), "DTensor", None)
        if isinstance(found, type):
            return found
    return None


def mesh_group_names_attribute(mesh: Any) -> Optional[str]:
    """The DeviceMesh attribute a collective looks its groups up in, by mesh dimension:
    ``_dim_group_names`` (torch 2.8+), ``_dim_group_infos`` (before: (tag, ranks, name) per
    dimension). None when the mesh has neither."""
    for name in ("_dim_group_names", "_dim_group_infos"):
        if type(getattr(mesh, name, None)) is list:
            return name
    return None


def gloo_prints_banner() -> bool:
    """Does making a gloo group print ``[Gloo] Rank N is connected to M peer ranks. Expected
    number of connected peer ranks is : M`` on stdout (fd 1, from C++)? Torch 2.8 does (2.9 too,
    in others' logs); 2.4, 2.6 and 2.13 do not. The versions between are counted in: keeping the
    line out costs nothing where none is printed."""
    return (2, 8) <= torch_version() < (2, 13)


#: The line gloo prints on each rank when its group is made, all connected (torch 2.8, 2.9).
GLOO_BANNER = re.compile(rb"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
                         rb"Expected number of connected peer ranks is : (\d+)\r?\n")


@contextlib.contextmanager
def quiet_gloo_banner():
    """Keep gloo's "[Gloo] Rank N is connected to M peer ranks" line, printed from C++ on fd 1
    when a group is made, out of this process's stdout (a notebook cell, when the caller is a
    rank): fd 1 goes to a memory file meanwhile, and what else came is written back. A line
    that says fewer peers are connected than expected is kept: it is news."""
    if not gloo_prints_banner():
        yield
        return
    try:
        sys.stdout.flush()
    except Exception:
        pass
    capture = os.memfd_create("mpify_nb-gloo", os.MFD_CLOEXEC)
    saved = os.dup(1)
    os.dup2(capture, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        try:
            os.lseek(capture, 0, os.SEEK_SET)
            chunks = []
            while True:
                chunk = os.read(capture, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
            text = drop_gloo_banner(b"".join(chunks))
            while text:
                text = text[os.write(1, text):]
        except OSError:
            pass
        finally:
            os.close(capture)


def drop_gloo_banner(data: bytes) -> bytes:
    """``data`` without gloo's all-connected lines (see :data:`GLOO_BANNER`)."""
    return GLOO_BANNER.sub(lambda m: b"" if m.group(1) == m.group(2) else m.group(0), data)


def quiet_cpp_warnings() -> Callable[[], None]:
    """Raise torch's C++ log level to ERROR in this process until the returned function is called.
    For a call that is failing: a store client whose server was killed prints a warning with a
    C++ stack of 20 lines ("recvValueWithTimeout failed"), an echo of the failure already
    reported. torch reads ``TORCH_CPP_LOG_LEVEL`` once, at start; the level lives on in libc10's
    ``FLAGS_caffe2_log_level``, which is set here (nothing happens where torch is not imported or
    the symbol is missing)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return lambda: None
    try:
        import ctypes

        library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__ or ""), "lib", "libc10.so"))
        level = ctypes.c_int.in_dll(library, "FLAGS_caffe2_log_level")
    except (OSError, ValueError, AttributeError):
        return lambda: None
    before = level.value
    level.value = max(before, 2)  # 2: ERROR

    def restore() -> None:
        level.value = before

    return restore


def is_rank_excepthook(hook: Any) -> bool:
    """``hook`` is one ``init_process_group`` installs over ``sys.excepthook`` (each group wraps
    the hook before it in one that prefixes "[rankN]: " to every line), not the user's."""
    return getattr(hook, "__qualname__", "").endswith("init_process_group.<locals>._distributed_excepthook")


def without_rank_excepthooks(hook: Any, fallback: Any) -> Any:
    """``hook`` without the "[rankN]: " wrappers of the groups made since (what each wrapped, down
    to a hook not torch's); ``fallback`` where a wrapper does not say what it wrapped."""
    while is_rank_excepthook(hook):
        names = hook.__code__.co_freevars
        if "old_hook" not in names or hook.__closure__ is None:
            return fallback
        hook = hook.__closure__[names.index("old_hook")].cell_contents
    return hook
