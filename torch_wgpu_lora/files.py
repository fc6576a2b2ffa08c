"""Durable, atomic file writes: the one way this package writes its outputs.

>>> import pathlib, tempfile
>>> path = write_atomic(pathlib.Path(tempfile.mkdtemp()) / "state.json", b"{}")
>>> path.read_bytes()
b'{}'

A file is written under a temporary name beside its target, synced, and renamed over
the target, and then the folder is synced, so after a crash the target holds the old
bytes or the new ones, never a mix. Temporary files and folders are created with the
mode ``open()`` and ``mkdir()`` would give them (0o666 and 0o777 less the umask), not
``tempfile``'s owner-only 0o600 and 0o700: what we write must be readable by whoever
the user's umask lets read it (a serving process, another user).

This module imports nothing from the package, so every layer can use it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

if os.name == "posix":
    import fcntl

__all__ = ["append_synced", "locked_dir", "make_temp_dir", "sync_dir", "write_atomic", "write_temp"]

_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)


def _temp_path(directory: Path, name: str, suffix: str) -> Path:
    return directory / f".{name}.{secrets.token_hex(4)}{suffix}"


def write_temp(directory: str | os.PathLike, name: str, data: bytes) -> Path:
    """``data`` in a new, synced temporary file in ``directory`` named after ``name``
    (``.NAME.XXXXXXXX.tmp``); the caller renames it into place (``os.replace``) or removes it.

    For commits of several files at once; ``write_atomic`` does the whole job for one.
    """
    directory = Path(directory)
    while True:
        tmp = _temp_path(directory, name, ".tmp")
        try:
            fd = os.open(tmp, _FILE_FLAGS, 0o666)  # the kernel applies the umask, as for open()
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def sync_dir(directory: str | os.PathLike) -> None:
    """Make the creations, renames and removals in ``directory`` durable (a no-op where
    folders cannot be opened, i.e. outside POSIX)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked_dir(directory: str | os.PathLike, shared: bool = False) -> Iterator[None]:
    """Hold an advisory lock on the folder ``directory`` while the block runs: exclusive for a
    writer that replaces several files in it one after the other, shared for a reader that must
    see them all from one writer's commit. Where folders cannot be locked (outside POSIX, some
    network filesystems) it holds none, and readers must detect a mixed read themselves.

    >>> # with locked_dir(folder): os.replace(tmp_a, folder / "a"); os.replace(tmp_b, folder / "b")
    """
    if os.name != "posix":
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        except OSError:  # not lockable here (e.g. NFS refuses flock on a folder opened read-only)
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


def write_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Replace the file ``path`` with ``data`` atomically and durably; returns ``path``.

    >>> # write_atomic("out/adapter.lora", payload)
    """
    path = Path(path)
    tmp = write_temp(path.parent, path.name, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_dir(path.parent)
    return path


def make_temp_dir(path: str | os.PathLike, suffix: str = ".tmp") -> Path:
    """A new empty folder beside ``path`` (``.NAME.XXXXXXXX.tmp``), to fill and then rename to ``path``.

    >>> # tmp = make_temp_dir(root / "step-000010"); ...fill...; os.replace(tmp, root / "step-000010")
    """
    path = Path(path)
    while True:
        tmp = _temp_path(path.parent, path.name, suffix)
        try:
            os.mkdir(tmp, 0o777)  # the kernel applies the umask, as for mkdir()
            return tmp
        except FileExistsError:
            continue


def append_synced(path: str | os.PathLike, text: str) -> None:
    """Append ``text`` (UTF-8) to the file ``path``, created if missing, and sync it.

    A crash can still cut the last append short: readers of such logs must expect a torn last line.
    """
    path = Path(path)
    created = not path.exists()
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    if created:
        sync_dir(path.parent)
