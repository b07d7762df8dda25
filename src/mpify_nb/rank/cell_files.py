"""A cell's source written where the frontend's debugger expects it, on the rank's machine, safely.

debugpy ignores a breakpoint in a file that does not exist where it runs, so a rank on another
host (Ray) writes the kernel's cell files itself: ``/tmp/ipykernel_<kernel pid>/<hash>.py``. That
directory's name is known to anyone, and on that host ipykernel never made it: another local user
may have made it first, with a link in it to a file of ours. So::

    the directory   made here (0o700) when missing; else used only if it is a real directory
                    (not a link), ours, and writable by nobody else
    the file        written under a new random name, created exclusively, without following a
                    link (O_EXCL | O_NOFOLLOW), in the directory opened once and checked (its
                    descriptor, not its name, from then on), then renamed over the cell's name
                    (a rename replaces a link there, it never follows it)
"""

from __future__ import annotations

import errno
import os
import secrets
import stat


def write_cell(path: str, code: str) -> tuple[bool, str]:
    """``code`` at ``path`` (an absolute ``.py`` path); (True, "") or (False, why not)."""
    if not os.path.isabs(path) or not path.endswith(".py") or os.path.basename(path) in ("", ".py"):
        return False, f"not a cell's file: {path!r}"
    directory, name = os.path.split(os.path.normpath(path))
    try:
        folder = _own_directory(directory)
    except OSError as e:
        return False, f"could not write {path}: {e}"
    try:
        try:
            found = os.stat(name, dir_fd=folder, follow_symlinks=False)
            if stat.S_ISREG(found.st_mode) and found.st_uid == os.geteuid():
                return True, ""  # written already (by the kernel, on its own host, or before)
        except FileNotFoundError:
            pass
        temporary = f".{name}.{secrets.token_hex(8)}"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(code)
            os.rename(temporary, name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            try:
                os.unlink(temporary, dir_fd=folder)
            except OSError:
                pass
            raise
    except OSError as e:
        return False, f"could not write {path}: {e}"
    finally:
        os.close(folder)
    return True, ""


def _own_directory(directory: str) -> int:
    """``directory`` opened (a descriptor), made 0o700 when missing; OSError unless it is a
    real directory of ours that nobody else may write to."""
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    try:
        folder = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(directory):
            raise PermissionError(f"not writing into {directory}: it is a link") from None
        raise
    found = os.fstat(folder)
    why = ""
    if found.st_uid != os.geteuid():
        why = f"it belongs to another user (uid {found.st_uid})"
    elif found.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        why = f"others may write to it (mode {stat.S_IMODE(found.st_mode):o})"
    if why:
        os.close(folder)
        raise PermissionError(f"not writing into {directory}: {why}")
    return folder
