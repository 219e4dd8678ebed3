"""One writer per workdir: an advisory lock on ``DIR/.lock``; and the removal of a new workdir that got nothing.

``revtrain train``, ``eval`` and ``check --workdir`` take the lock before they write (or read checkpoints a
writer could be changing); a second command on the same workdir is refused at once with one line naming the
holder. A disk-tier run whose ``ReversibleTrainer.offload_dir`` lies outside its workdir locks that directory
the same way: two runs writing layer files there would overwrite each other's. The lock is ``flock(2)`` on the
open file: the kernel releases it when the holding process ends in any way (exit, crash, ``kill -9``), so a
lock left by a dead process never blocks the next run and nothing needs cleaning up. The file stays (empty or
with the last holder's PID, host, command and start time); only a held lock counts. On NFS, Linux emulates
``flock`` with POSIX byte-range locks, which works across hosts with NFSv4 (or NFSv3 with lockd).

Multi-host: process 0 takes the lock for all processes and tells them whether it got it, so that every
process of a refused run stops with the same error (`acquire`).

Commands that only read (``revtrain sample``) need no lock: checkpoints are renamed into place complete,
and `revtrain.checkpoint.Checkpointer.restore_newest` skips a damaged one.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import shutil
import socket

from revtrain.errors import InputError

LOCK_FILE = ".lock"


class WorkdirBusy(InputError, RuntimeError):
    """Another process holds the workdir's lock (one line naming it; exit status 2)."""


def _holder(fd: int) -> str:
    """Who holds the lock, from the lock file's contents (written by the holder just after it locked)."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096).decode() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info.get("pid"):
        return "another process"
    since = f", since {info['since']}" if info.get("since") else ""
    command = f"revtrain {info['command']}, " if info.get("command") else ""
    return f"{command}PID {info['pid']} on host {info.get('host', '?')}{since}"


class WorkdirLock:
    """Holds the exclusive lock on ``<workdir>/.lock`` (created if missing) until `release`.

    Args:
      workdir: an existing directory.
      command: what holds it (``"train"``, ``"eval"``, ``"check"``), shown to a refused process.
      name: what the directory is, in the refusal (``"the workdir"``, ``"ReversibleTrainer.offload_dir"``).
      instead: what a refused user can do instead (the refusal's end).

    Raises:
      WorkdirBusy: another process holds the lock (the message names it: command, PID, host, since when).
      OSError: the lock file cannot be opened (other than a read-only workdir: then nothing is locked,
        since nobody can write there; `held` is False).
    """

    def __init__(self, workdir: str, command: str, name: str = "the workdir", instead: str = "use another --workdir"):
        self.path = os.path.join(os.path.abspath(workdir), LOCK_FILE)
        self.fd: int | None = None
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                return  # a read-only workdir: nothing to protect
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise WorkdirBusy(f"{name} {os.path.dirname(self.path)} is in use by {holder}; wait for it to "
                              f"finish or {instead}") from None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
                "since": datetime.datetime.now().isoformat(timespec="seconds")}
        try:
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(info).encode())
        except OSError:
            pass  # the lock holds without its description (e.g. the disk is full)
        self.fd = fd

    @property
    def held(self) -> bool:
        return self.fd is not None

    def release(self) -> None:
        """Releases the lock (closing the file; idempotent)."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)


def acquire(workdir: str, command: str, **words) -> WorkdirLock | None:
    """Locks ``workdir`` for ``command`` on behalf of every process of the run (``words``: `WorkdirLock`'s
    ``name`` and ``instead``).

    Single process: a `WorkdirLock`. Multi-process (``jax.distributed``): process 0 takes the lock and
    broadcasts whether it got it; it returns the lock, the other processes None.

    Raises:
      WorkdirBusy: the workdir is locked by another process (on every process of the run).
    """
    import jax
    lock, error = None, None
    if jax.process_index() == 0:
        try:
            lock = WorkdirLock(workdir, command, **words)
        except WorkdirBusy as e:
            error = e
    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils
        ok = bool(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
        if not ok and error is None:
            error = WorkdirBusy(f"process 0 could not lock the workdir {os.path.abspath(workdir)}: it is in use "
                                "by another run; wait for it to finish or use another --workdir")
    if error is not None:
        raise error
    return lock


@contextlib.contextmanager
def locked(workdir: str, command: str):
    """``with locked(workdir, command):`` holds the lock of `acquire` for the block and releases it after.

    Raises:
      WorkdirBusy: as `acquire`.
    """
    lock = acquire(workdir, command)
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()


def saved_nothing(workdir: str) -> bool:
    """Whether ``workdir`` holds no complete checkpoint (``checkpoints/<step>/``) and no metrics record
    (a non-empty ``metrics/*.jsonl``): what a run stopped before its first step or first save leaves."""
    for sub, keep in (("checkpoints", lambda name, path: name.isdigit()),
                      ("metrics", lambda name, path: name.endswith(".jsonl") and os.path.getsize(path) > 0)):
        directory = os.path.join(workdir, sub)
        try:
            if any(keep(name, os.path.join(directory, name)) for name in os.listdir(directory)):
                return False
        except FileNotFoundError:
            continue
        except OSError:
            return False
    return True


def remove_if_unsaved(workdir: str) -> bool:
    """Deletes ``workdir`` when it `saved_nothing`; for a workdir the failing run created itself (a run that
    got as far as a checkpoint or a metrics record keeps it, for the record). Returns whether it was
    removed."""
    if not saved_nothing(workdir):
        return False
    shutil.rmtree(workdir, ignore_errors=True)
    return not os.path.exists(workdir)
