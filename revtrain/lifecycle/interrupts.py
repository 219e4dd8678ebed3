"""SIGINT / SIGTERM during ``revtrain train``: stop promptly, never lose or corrupt a checkpoint.

The policy (`Interrupts`):

* While nothing is unsaved (``idle``): before the first step of this run has finished (start-up, data
  preparation, XLA's compile of the first step) and after the final checkpoint is written, a signal
  stops the run at once with exit status 0: waiting would save nothing new.
* Otherwise the first signal asks the loop to stop after the current step (``signal`` is set); the loop
  saves that step and exits 0.
* A second signal stops at once, with exit status 128 + the signal's number: the steps after the newest
  checkpoint are lost (the line says which checkpoint is kept).
* Signals that arrive together count as one: a signal within `BURST_WINDOW` seconds (1 s; the
  environment variable ``REVTRAIN_SIGNAL_BURST_SECONDS`` sets another, 0 turns it off) of the previous one
  that counted is ignored. ``timeout``, SLURM's ``scancel`` and ``mpirun`` send their SIGTERM to the
  process and to its whole process group at once (so revtrain, and the Python interpreter that runs it,
  receive it twice within microseconds); a second signal means someone asked again.

``revtrain eval``, ``sample`` and ``check`` follow the same rules through `command_interrupts`: eval's
step is one checkpoint's scoring (the first signal finishes it, writes its record and stops; a second
loses it), while sampling and checking have no step to finish, so a signal during them stops at once
(exit 128 + its number, the line saying what was finished and what was not); before their work starts
(loading, preparing data) a signal stops at once with exit 0.

Stopping at once must work while the main thread is inside XLA (compiling the first step of a deep model
can take many minutes, and Python runs signal handlers only between the main thread's bytecodes). The
C-level handler writes each signal's number to a pipe (`signal.set_wakeup_fd`), which wakes a watcher
thread (XLA releases the GIL while it compiles and runs). To stop, the watcher replaces the process with
the stdlib-only script ``revtrain/lifecycle/_stopped.py`` (``os.execv``, same PID): exec ends every other thread at
once, Orbax's checkpoint writers included, so the cleanup that follows cannot race with a write. The
script deletes the unfinished ``*.orbax-checkpoint-tmp*`` directory, and the workdir this run created when
it holds no checkpoint and no metrics record; then prints one line naming the newest checkpoint on disk and exits. The
workdir's lock (`revtrain.lifecycle.workdir`) is handed over to it, so no other run starts in the workdir until the
cleanup is done. No traceback, and no false "cannot write the checkpoint" error, whatever the main thread
was doing.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

STOPPED_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_stopped.py")
SIGNALS = (signal.SIGINT, signal.SIGTERM)
BURST_WINDOW = 1.0  # seconds: signals closer together than this count as one (REVTRAIN_SIGNAL_BURST_SECONDS)


def burst_window() -> float:
    """`BURST_WINDOW`, or the environment's ``REVTRAIN_SIGNAL_BURST_SECONDS`` (0 turns bursts off)."""
    value = os.environ.get("REVTRAIN_SIGNAL_BURST_SECONDS", "").strip()
    try:
        return max(0.0, float(value)) if value else BURST_WINDOW
    except ValueError:
        return BURST_WINDOW


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Interrupts:
    """Context manager installing the stop policy of ``revtrain train`` (see the module docstring).

    Installs handlers only in the main thread (elsewhere it does nothing: signals go to the main thread's
    handlers, whatever they are). The loop tells it what is on disk through its attributes.

    Attributes:
      signal: the first signal received while work was unsaved (the loop then stops after the step), or
        None.
      idle: True while nothing is unsaved (a signal stops at once, exit 0); ``idle_note`` says why, for
        the stop line ("before the first step finished: nothing new to save").
      checkpoint_dir: the run's ``checkpoints/`` (its unfinished saves are deleted on a stop), or None.
      workdir: the workdir, deleted on a stop when ``created`` and it holds no checkpoint and no metrics.
      lock: the workdir's `revtrain.lifecycle.workdir.WorkdirLock` (handed to the cleanup), or None.
      primary: whether this process cleans up (process 0).
      log: prints one line (process 0's stderr).
      at_once: a signal while work is in progress stops at once (no step to finish: sample, check).
      first_note: what the line of a first signal while work is unsaved says after the signal's name.
      lost_note: what a stop at once while work is in progress loses (a string, or a function returning
        one when the signal comes).
      report_checkpoints: whether the stop line names the newest checkpoint (``train``) or not.
    """

    def __init__(self, log=None):
        self.signal: int | None = None
        self.idle = True
        self.idle_note = "before the first step finished: nothing new to save"
        self.checkpoint_dir: str | None = None
        self.workdir: str | None = None
        self.created = False
        self.lock = None
        self.primary = True
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.at_once = False
        self.first_note = "saving and stopping after the current step; send it again to stop at once"
        self.lost_note = "the steps after the newest checkpoint are lost"
        self.report_checkpoints = True
        self._last_signal: float | None = None
        self.burst_window = burst_window()
        self._mutex = threading.Lock()
        self._installed = False

    def __enter__(self) -> "Interrupts":
        if threading.current_thread() is not threading.main_thread():
            return self
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._old_handlers = {sig: signal.signal(sig, self._python_handler) for sig in SIGNALS}
        self._old_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, name="revtrain-signals", daemon=True)
        self._watcher.start()
        self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if not self._installed:
            return
        self._installed = False
        signal.set_wakeup_fd(self._old_fd)
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        os.write(self._write, b"\0")  # ends the watcher (no signal has number 0)
        self._watcher.join(timeout=10)
        os.close(self._read)
        os.close(self._write)

    @staticmethod
    def _python_handler(signum, frame) -> None:
        """The Python-level handler does nothing (no KeyboardInterrupt): the watcher thread acts."""

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self._read, 64)
            except OSError:
                return
            for signum in data:
                if signum == 0:
                    return
                self._on_signal(signum)

    def _on_signal(self, signum: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._mutex:
            if self._last_signal is not None and now - self._last_signal < self.burst_window:
                return  # the same burst (see BURST_WINDOW)
            self._last_signal = now
            name = signal_name(signum)
            if self.idle:
                self.stop_now(signum, f"received {name} {_text(self.idle_note)}", code=0)
            elif self.at_once:
                self.stop_now(signum, f"received {name}: stopped at once, {_text(self.lost_note)}",
                              code=128 + signum)
            elif self.signal is None:
                self.signal = signum
                self.log(f"received {name}: {_text(self.first_note)}")
            else:
                self.stop_now(signum, f"received {name} again: stopped at once, {_text(self.lost_note)}",
                              code=128 + signum)

    def stop_now(self, signum: int, message: str, code: int) -> None:
        """Replaces this process with the cleanup script (see the module docstring); does not return."""
        spec = {"message": message, "code": code, "checkpoints": self.checkpoint_dir,
                "workdir": self.workdir if self.created else None, "primary": self.primary,
                "report_checkpoints": self.report_checkpoints}
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        fd = getattr(self.lock, "fd", None)
        try:
            if fd is not None:
                os.set_inheritable(fd, True)
            # The rest of a burst must not end the cleanup script before it ignores SIGINT / SIGTERM: a
            # blocked signal stays blocked across exec, and is discarded once the script ignores it.
            signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
            os.execv(sys.executable, [sys.executable, "-I", "-S", STOPPED_SCRIPT, json.dumps(spec)])
        except OSError:  # no interpreter to exec: stop without the cleanup
            print(f"revtrain: {message}", file=sys.stderr, flush=True)
            os._exit(code)


def _text(note) -> str:
    return note() if callable(note) else note


def command_interrupts(command: str, at_once: bool) -> Interrupts:
    """An `Interrupts` for ``revtrain eval`` / ``sample`` / ``check`` (see the module docstring): the stop
    line names no checkpoint, and a signal before the command's work starts stops at once with exit 0.

    The command sets ``idle = False`` when its work starts, and ``lost_note`` (what a stop at once loses,
    and what was finished) as it goes.

    Args:
      command: the command's name, for the lines ("eval", "sample", "check").
      at_once: whether a signal during the work stops at once (True: no step to finish).
    """
    guard = Interrupts()
    guard.report_checkpoints = False
    guard.at_once = at_once
    guard.idle_note = f"before {command} started: nothing was lost"
    guard.lost_note = f"{command} did not finish"
    return guard
