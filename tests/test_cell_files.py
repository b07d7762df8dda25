"""A rank writes the frontend's cell files (for its debugger) only into a directory of this user's,
never through a link (issue 35). The directory's name, /tmp/ipykernel_<pid>, is known to anyone,
and on a Ray node ipykernel never made it: another local user's directory there, with a dangling
link named after a cell, made a rank create a file in the victim's home."""

from __future__ import annotations

import os
import stat

import pytest

from mpify_nb.rank.cell_files import write_cell

CODE = "a = 1\nb = a + 1\n"


@pytest.fixture
def victim(tmp_path):
    """A file of ours that a link points to, which must never be created."""
    return tmp_path / "home" / ".profile_written_by_a_rank"


def plant(directory, victim, name="4098291876.py"):
    directory.mkdir(mode=0o700, exist_ok=True)
    victim.parent.mkdir(exist_ok=True)
    os.symlink(victim, directory / name)
    return str(directory / name)


def test_a_dangling_link_in_our_own_directory_is_replaced_never_followed(tmp_path, victim):
    path = plant(tmp_path / "ipykernel_1", victim)
    assert write_cell(path, CODE) == (True, "")
    assert not victim.exists()
    assert not os.path.islink(path) and stat.S_ISREG(os.lstat(path).st_mode)
    assert open(path).read() == CODE
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert sorted(os.listdir(tmp_path / "ipykernel_1")) == ["4098291876.py"]  # no temporary left


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory of another user takes root")
def test_another_users_directory_is_refused(tmp_path, victim):
    directory = tmp_path / "ipykernel_2"
    path = plant(directory, victim)
    os.chown(directory, 4242, 4242, follow_symlinks=False)
    os.chown(path, 4242, 4242, follow_symlinks=False)
    assert write_cell(path, CODE) == (False, f"could not write {path}: not writing into {directory}: it belongs "
                                             "to another user (uid 4242)")
    assert not victim.exists()


def test_a_directory_others_may_write_to_is_refused(tmp_path, victim):
    directory = tmp_path / "ipykernel_3"
    path = plant(directory, victim)
    os.chmod(directory, 0o777)
    assert write_cell(path, CODE) == (False, f"could not write {path}: not writing into {directory}: others may "
                                             "write to it (mode 777)")
    assert not victim.exists()


def test_a_directory_that_is_a_link_is_refused(tmp_path, victim):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, tmp_path / "ipykernel_4")
    path = str(tmp_path / "ipykernel_4" / "1.py")
    assert write_cell(path, CODE) == (False, f"could not write {path}: not writing into {tmp_path / 'ipykernel_4'}: "
                                             "it is a link")
    assert os.listdir(elsewhere) == []


def test_a_missing_directory_is_made_ours_and_an_existing_file_is_kept(tmp_path):
    path = str(tmp_path / "ipykernel_5" / "2.py")
    assert write_cell(path, CODE) == (True, "")
    assert stat.S_IMODE(os.stat(tmp_path / "ipykernel_5").st_mode) == 0o700
    assert open(path).read() == CODE
    assert write_cell(path, "something else\n") == (True, "")  # the kernel's own copy, or an earlier one
    assert open(path).read() == CODE
    assert write_cell("relative.py", CODE)[0] is False and write_cell(str(tmp_path / "x.txt"), CODE)[0] is False
