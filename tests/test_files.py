"""The one atomic write: files appear whole or not at all, are synced, and get the mode the umask
gives (as open() and mkdir() would), not tempfile's owner-only 0o600/0o700."""

from __future__ import annotations

import os
import stat

import pytest

from torch_wgpu_lora import files
from torch_wgpu_lora.files import append_synced, make_temp_dir, write_atomic, write_temp


@pytest.fixture(params=[0o022, 0o077, 0o002])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_files_and_folders_get_the_mode_the_umask_gives(tmp_path, umask):
    reference_file, reference_dir = tmp_path / "opened", tmp_path / "made"
    reference_file.write_bytes(b"")  # what open() and mkdir() give under this umask: the reference
    reference_dir.mkdir()
    assert mode(write_atomic(tmp_path / "a.bin", b"x")) == mode(reference_file) == 0o666 & ~umask
    assert mode(write_temp(tmp_path, "b.bin", b"x")) == 0o666 & ~umask
    assert mode(make_temp_dir(tmp_path / "c")) == mode(reference_dir) == 0o777 & ~umask
    append_synced(tmp_path / "log.jsonl", "{}\n")
    assert mode(tmp_path / "log.jsonl") == 0o666 & ~umask


def test_write_atomic_replaces_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "state.json"
    write_atomic(path, b"old")
    assert write_atomic(path, b"new") == path and path.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["state.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path, monkeypatch):
    path = tmp_path / "adapter.lora"
    write_atomic(path, b"old")

    def full_disk(fd):
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="simulated"):
        write_atomic(path, b"new")
    monkeypatch.undo()
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["adapter.lora"]


def test_writes_are_synced_file_then_folder(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def record(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    write_atomic(tmp_path / "a", b"x")
    assert synced == [False, True]  # the data, then the rename in the folder
    synced.clear()
    append_synced(tmp_path / "log", "1\n")  # a new file: its folder entry too
    append_synced(tmp_path / "log", "2\n")
    assert synced == [False, True, False]
    assert (tmp_path / "log").read_text() == "1\n2\n"


def test_temporary_names_sit_beside_the_target_hidden(tmp_path):
    tmp = make_temp_dir(tmp_path / "step-000010")
    assert tmp.parent == tmp_path and tmp.name.startswith(".step-000010.") and tmp.name.endswith(".tmp")
    assert make_temp_dir(tmp_path / "step-000010", suffix=".old").name.endswith(".old")
    assert make_temp_dir(tmp_path / "step-000010") != tmp  # never the same folder twice
    assert files.write_temp(tmp_path, "x.json", b"{}").name.startswith(".x.json.")
