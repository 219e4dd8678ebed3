"""A lost process in a multi-process run: one line, exit status 1, within a bounded time, no C++ abort.

When one process of a multi-process run dies (``kill -9``, a crashed host, a lost network link), every
other process must stop: it cannot take a step without its peer. JAX 0.10.2 stops them in two ways, both
abrupt: a cross-process collective that was in flight fails at once (gloo on the CPU: ``Gloo AllGather
failed: ... Connection reset by peer``), and the coordination service (the gRPC server in process 0)
tells every process that a task stopped sending heartbeats once ``heartbeat_timeout`` seconds passed; the
client then terminates the process from a C++ thread (a fatal log line, a stack trace and SIGABRT). When
process 0 itself is lost, the others see the coordination service go away at once.

revtrain turns both into the same single line on stderr, for example::

    revtrain: error: lost process 1 of 2 (it stopped sending heartbeats); stopped after step 257; the newest checkpoint (step 255) is kept; start the same command on every host to resume

and exits with status 1 through ``os._exit`` (no Python or C++ exit handlers: JAX's would wait up to its
shutdown timeout for the lost peer and then abort). Checkpoints are never damaged by this: a save that
was in flight stays an unfinished ``*.orbax-checkpoint-tmp*`` directory, which the resumed run deletes.

How the C++ side is intercepted (`initialize`): the client is created with a Python
``missed_heartbeat_callback``; JAX 0.10.2's binding cannot convert the error status it passes to Python
and calls ``std::terminate`` instead, so revtrain also installs its own C++ terminate handler (through
``ctypes``, in ``libstdc++``), which reports the loss the same way. Either path ends in `report`.

The time bound: a survivor inside a step notices at once (its collective fails); one that is compiling,
evaluating or saving notices when the coordination service does, ``heartbeat_timeout`` seconds after
the peer's last heartbeat (``--heartbeat_timeout``, default `DEFAULT_HEARTBEAT_TIMEOUT`); when process 0
is the one lost, the others notice at once.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import threading

DEFAULT_HEARTBEAT_TIMEOUT = 100  # seconds (JAX's own default)

_state = {"checkpoints": None, "step": None, "process": 0, "processes": 1, "active": False}
_report_lock = threading.Lock()
_keep = []  # the ctypes callbacks (they must outlive the C++ side's use of them)


def watch(checkpoint_dir: str | None = None, step: int | None = None) -> None:
    """Tells the report which checkpoint directory to name and the step the run is at."""
    if checkpoint_dir is not None:
        _state["checkpoints"] = checkpoint_dir
    if step is not None:
        _state["step"] = step


def newest_checkpoint(checkpoint_dir: str | None) -> int | None:
    """The newest complete checkpoint step in ``checkpoint_dir`` (a directory named by its step), or None."""
    try:
        steps = [int(n) for n in os.listdir(checkpoint_dir) if n.isdigit()] if checkpoint_dir else []
    except OSError:
        return None
    return max(steps) if steps else None


def _who() -> tuple[str, str]:
    """(the lost process, a note on it) as far as this process can tell."""
    pc, pi = _state["processes"], _state["process"]
    if pc == 2:
        return f"process {1 - pi} of 2", "the coordinator; " if pi == 1 else ""
    return f"another of the {pc} processes", ""


def report_line(how: str) -> str:
    """The one line a survivor prints (see the module docstring)."""
    who, note = _who()
    line = f"revtrain: error: lost {who} ({note}{how})"
    if _state["step"] is not None:
        line += f"; stopped after step {_state['step']}"
    newest = newest_checkpoint(_state["checkpoints"])
    if _state["checkpoints"] is None:
        line += "; nothing was being trained"
    elif newest is None:
        line += "; no checkpoint was written"
    else:
        line += f"; the newest checkpoint (step {newest}) is kept"
    return line + "; start the same command on every host to resume"


def report(how: str) -> None:
    """Prints `report_line` once on stderr and ends the process at once with status 1 (never returns)."""
    with _report_lock:  # the first reporter wins; any other blocks until the process is gone
        try:
            sys.stderr.flush()
            os.write(2, (report_line(how) + "\n").encode())
        finally:
            os._exit(1)


_PEER_PATTERNS = (r"Gloo \w+ failed", r"Connection reset by peer", r"Connection closed by peer",
                  r"coordination service", r"heartbeat")


def is_peer_failure(e: BaseException) -> bool:
    """Whether ``e`` (raised by a JAX call) means another process of the run is gone."""
    if not _state["active"]:
        return False
    text = str(e)
    return any(re.search(p, text, re.I) for p in _PEER_PATTERNS)


def peer_failure_reason(e: BaseException) -> str:
    """A short reason from a collective's error text ("a collective failed: Connection reset by peer")."""
    text = str(e)
    m = re.search(r"(Connection (?:reset|closed) by peer|Broken pipe|Socket closed|timed out)", text, re.I)
    return f"a collective failed: {m.group(1) if m else (text.strip().splitlines() or ['unknown error'])[0][:120]}"


def exit_if_peer_lost(e: BaseException) -> None:
    """Calls `report` when ``e`` is a peer failure of a multi-process run; returns otherwise."""
    if is_peer_failure(e):
        report(peer_failure_reason(e))


def _service_reason() -> str:
    if _state["process"] == 0:
        return "it stopped sending heartbeats"
    if _state["processes"] == 2:
        return "its coordination service is gone"
    return "the coordination service reported a lost process, or process 0 is gone"


def _on_service_error(*args) -> None:
    report(_service_reason())


def _on_terminate() -> None:
    report(_service_reason())


def _install_terminate_handler() -> bool:
    """Installs `_on_terminate` as the C++ terminate handler (libstdc++). Returns whether it could."""
    try:
        lib = ctypes.CDLL("libstdc++.so.6")
        set_terminate = lib._ZSt13set_terminatePFvvE  # std::set_terminate(void (*)())
    except (OSError, AttributeError):
        return False
    handler = ctypes.CFUNCTYPE(None)(_on_terminate)
    _keep.append(handler)
    set_terminate.restype = ctypes.c_void_p
    set_terminate.argtypes = [ctypes.c_void_p]
    set_terminate(ctypes.cast(handler, ctypes.c_void_p))
    return True


def _private(module: str, name: str):
    """``jax._src.<module>.<name>``, or None when this JAX has no such thing.

    revtrain uses public JAX only, except for the two hooks below, which JAX does not expose: each use is
    guarded by this function and has a fallback (`backends_started`, `initialize`), tested by making it
    return None."""
    import importlib
    try:
        return getattr(importlib.import_module(f"jax._src.{module}"), name)
    except (ImportError, AttributeError):
        return None


def backends_started() -> bool | None:
    """Whether JAX's backends have started (then it is too late for ``jax.distributed`` and for gloo), or
    None when this JAX cannot say without starting them (``jax.distributed.initialize`` then raises its
    own ``RuntimeError``, which the CLI reports the same way)."""
    query = _private("xla_bridge", "backends_are_initialized")
    return None if query is None else bool(query())


def initialize(heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT, **kwargs) -> None:
    """``jax.distributed.initialize(**kwargs)`` with a lost peer reported by `report` (module docstring).

    The hook: JAX's distributed client is made by ``jax._src.lib._jax.get_distributed_runtime_client``,
    which `initialize` wraps for the call to add the ``missed_heartbeat_callback``; the process id and
    count come from ``jax._src.distributed.global_state`` (``jax.process_count()`` would start the
    backends here). Both are private (`_private`); on a JAX without them, the run still starts: without
    the callback a lost peer ends the process as JAX does (its C++ log line and abort, unless the terminate
    handler catches it), and the process id and count are taken from ``kwargs`` or, when JAX found them
    itself, from ``jax.process_index()`` / ``jax.process_count()``.

    Args:
      heartbeat_timeout: seconds without a heartbeat after which the coordination service declares a
        process lost (JAX's ``heartbeat_timeout_seconds``); a positive integer.
      kwargs: passed to ``jax.distributed.initialize``.

    Raises:
      whatever ``jax.distributed.initialize`` raises.
    """
    import jax

    runtime = _private("lib", "_jax")
    make_client = getattr(runtime, "get_distributed_runtime_client", None)

    def client(*args, **kw):
        kw.setdefault("missed_heartbeat_callback", _on_service_error)
        return make_client(*args, **kw)

    _install_terminate_handler()
    if make_client is not None:
        runtime.get_distributed_runtime_client = client
    try:
        jax.distributed.initialize(heartbeat_timeout_seconds=int(heartbeat_timeout), **kwargs)
    finally:
        if make_client is not None:
            runtime.get_distributed_runtime_client = make_client
    state = _private("distributed", "global_state")
    if state is not None:
        process, processes = state.process_id, state.num_processes
    elif "process_id" in kwargs and "num_processes" in kwargs:
        process, processes = kwargs["process_id"], kwargs["num_processes"]
    else:
        process, processes = jax.process_index(), jax.process_count()
    _state.update(process=process, processes=processes, active=processes > 1)
