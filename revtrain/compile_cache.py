"""The compiled programs kept on disk between commands: JAX's persistent compilation cache, on by default.

Every ``revtrain`` command compiles the trainer's programs before its first step: the memory plan and the
budget planner compile and read them (``budget_objective = 'time'`` runs each once more to time it), and the
run then finds them compiled. On the default model that is 9 programs and about 18 compile-seconds a start on
2 CPU cores; with the executables kept on disk a second start of the same model, shapes and flags fetches them
instead (docs/budget.md: a 'time' plan 21.4 s cold, 7.9 s warm). A cached executable is the same binary XLA
built, so nothing computed changes, bit for bit.

Where (`resolve`): ``$REVTRAIN_COMPILE_CACHE`` if set (a directory, or ``off``, ``0`` or empty for none), else
``$XDG_CACHE_HOME/revtrain/xla`` (``~/.cache/revtrain/xla``), beside the prepared data
(``~/.cache/revtrain/data``). A cache the user gave JAX itself (``JAX_COMPILATION_CACHE_DIR``, or
``jax_compilation_cache_dir`` set before the command) is left as it is. Every program is kept, however short its
compile (JAX keeps only those over a second by default: the planner's are 0.1-4 s each), and the directory is held
to `MAX_BYTES` by JAX's least-recently-used eviction, whose file lock (the ``filelock`` package) also serialises
processes sharing it: the hosts of a multi-host run (JAX writes from process 0 only) or several runs on one
machine. A directory that cannot be created leaves the command uncached, never failed. A cache hit compiles
nothing, so XLA's own dumps (``--xla_dump_to``) stay empty for it: ``REVTRAIN_COMPILE_CACHE=off`` compiles afresh.

Lineage: JAX's persistent compilation cache (``jax.config`` ``jax_compilation_cache_dir``, its
``jax_compilation_cache_max_size`` eviction); MaxText turns it on by default (its ``jax_cache_dir`` setting,
``~/jax_cache``).
"""

from __future__ import annotations

import os

# The cache's size on disk, bytes: least recently used entries are evicted past it (the default model's
# planned programs take about 1 MiB).
MAX_BYTES = 2 << 30
_OFF = ("", "0", "off", "none", "false")


def resolve(environ=None) -> str | None:
    """The directory the cache goes to, or None for no cache of revtrain's own (turned off, or a cache the user
    gave JAX: ``JAX_COMPILATION_CACHE_DIR``). ``environ``: the environment (``os.environ``)."""
    environ = os.environ if environ is None else environ
    if environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    if "REVTRAIN_COMPILE_CACHE" in environ:
        value = environ["REVTRAIN_COMPILE_CACHE"].strip()
        return None if value.lower() in _OFF else os.path.expanduser(value)
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "revtrain", "xla")


def enable(environ=None) -> str | None:
    """Turns JAX's persistent compilation cache on at `resolve`'s directory, before anything is compiled
    (a process-wide setting: call it once, at a command's start). Returns the directory, or None where none is
    set here (off, the user's own, already configured in this process, or a directory that cannot be made)."""
    import jax
    directory = resolve(environ)
    if directory is None or jax.config.jax_compilation_cache_dir:
        return None
    try:
        import filelock  # noqa: F401  (JAX's eviction needs it; without it, no cache rather than a failed compile)
        os.makedirs(directory, exist_ok=True)
    except (ImportError, OSError):
        return None
    if not os.access(directory, os.W_OK):
        return None
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return directory
