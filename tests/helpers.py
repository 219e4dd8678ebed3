"""What the tests share: the repository's paths, the environment of a revtrain subprocess, a revtrain run in a
subprocess, the metrics records a run wrote, and a few steps of a trainer in this process.

Imported as ``from helpers import ...`` (pytest puts ``tests/`` on the path for its rootdir conftest).
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"
CONFIG = str(CONFIGS / "enwik_small.gin")  # the default config most CLI tests shrink with --gin bindings

# Variables a launcher (SLURM, Open MPI, a JAX cluster) sets that would make a test's process join a cluster.
LAUNCHER_PREFIXES = ("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS", "SLURM_",
                     "OMPI_", "PMI_")


def env(devices: int | None = None, data_dir: str | None = None, isolated: bool = False, **extra) -> dict:
    """The environment of a revtrain subprocess: this one's, with the checkout on ``PYTHONPATH``.

    Args:
      devices: simulated CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count``); None: the default
        (the caller's ``XLA_FLAGS`` removed, so pytest's own settings never leak into the child).
      data_dir: ``REVTRAIN_DATA_DIR`` of the child (None: inherited).
      isolated: also drop every launcher variable and ``JAX_PLATFORMS`` (then ``cpu``): a process of a
        two-process ``jax.distributed`` run started by the test itself.
      **extra: further variables (strings).
    """
    if isolated:
        child = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES + ("JAX_PLATFORMS",))}
        child["JAX_PLATFORMS"] = "cpu"
    else:
        child = dict(os.environ)
    child["PYTHONPATH"] = str(REPO)
    child.pop("XLA_FLAGS", None)
    if devices:
        child["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    if data_dir is not None:
        child["REVTRAIN_DATA_DIR"] = str(data_dir)
    child.update(extra)
    return child


def revtrain(*args, cwd=None, timeout: float = 300, devices: int | None = None, child_env: dict | None = None,
             prefix=(), **env_extra) -> subprocess.CompletedProcess:
    """``python -m revtrain ARGS`` in a subprocess (text output captured; never raises on a non-zero exit).

    Args:
      *args: the command line after ``revtrain`` (strings or paths).
      cwd: the child's working directory.
      timeout: seconds before ``subprocess.TimeoutExpired``.
      devices, **env_extra: passed to `env` (ignored when ``child_env`` is given).
      child_env: the whole environment, instead of `env`'s.
      prefix: command words before the interpreter (a wrapper that runs it, e.g. in a memory cgroup).
    """
    return subprocess.run([*prefix, sys.executable, "-m", "revtrain", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout,
                          env=child_env if child_env is not None else env(devices, **env_extra))


def revtrain_here(capture, *args) -> subprocess.CompletedProcess:
    """``revtrain ARGS`` in this process (`revtrain.cli.main`, which runs one command after another), with
    `revtrain`'s result: its output is what ``capture`` (pytest's ``capsys`` or ``capfd``) read meanwhile.
    No interpreter to start and no JAX to import: what a command compiles stays compiled for the next. The
    environment is restored after it: a command sets variables for its own process (``train`` sizes XLA's
    pinned pool, `revtrain.pinned.train_environment`, when it runs before the backend starts), which would
    otherwise reach the later tests of this process."""
    from revtrain import cli
    capture.readouterr()
    environ = dict(os.environ)
    try:
        code = cli.main([str(a) for a in args])
    finally:
        os.environ.clear()
        os.environ.update(environ)
    out, err = capture.readouterr()
    return subprocess.CompletedProcess(["revtrain", *map(str, args)], code, out, err)


def records(workdir, kind: str = "train") -> list[dict]:
    """The JSON records of ``WORKDIR/metrics/KIND.jsonl`` in file order (blank lines skipped)."""
    path = pathlib.Path(workdir) / "metrics" / f"{kind}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def records_by_step(workdir, kind: str = "train") -> dict[int, dict]:
    """`records` keyed by ``step``, only those with a ``loss`` (a later record of a step wins: a resumed run)."""
    return {r["step"]: r for r in records(workdir, kind) if "loss" in r}


def losses(workdir, kind: str = "train") -> dict[int, float]:
    """``step -> loss`` of `records_by_step`."""
    return {step: r["loss"] for step, r in records_by_step(workdir, kind).items()}


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now (for a test's ``jax.distributed`` coordinator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model(num_layers: int = 2, d_model: int = 32, sequence_length: int = 128, num_heads: int = 2,
               dropout_rate: float = 0.1, **kwargs):
    """The tests' tiny model: a `ReversibleTransformerLM` of ``num_layers`` blocks of width ``d_model`` on byte
    sequences of ``sequence_length`` (defaults: 2 blocks of width 32, 2 heads, dropout 0.1, 128 bytes; about
    54 k parameters), seed 0; ``kwargs`` go to the model (``grid_bits``, ``attention``, ...). The
    ``tiny_model`` fixture of tests/conftest.py."""
    from revtrain.models import ReversibleTransformerLM
    return ReversibleTransformerLM(sequence_length, num_layers=num_layers, d_model=d_model, num_heads=num_heads,
                                   dropout_rate=dropout_rate, **kwargs)


def byte_batches(steps: int, sequence_length: int = 16, batch_size: int = 4, seed: int = 0) -> list:
    """``steps`` batches of random bytes (``numpy.random.default_rng(seed)``), each ``{'inputs': x, 'targets':
    x}`` with ``x`` int32 ``[batch_size, sequence_length]`` in 0 .. 255 (the same array twice)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        x = rng.integers(0, 256, (batch_size, sequence_length)).astype(np.int32)
        out.append({"inputs": x, "targets": x})
    return out


def train_steps(trainer, batches, mesh=None):
    """One ``train_step`` of ``trainer`` per batch (host numpy ``{'inputs', 'targets'}``, placed with
    `revtrain.placement.global_batch` on ``mesh``, default the trainer's), from ``trainer.init()``. The
    ``train_steps`` fixture of tests/conftest.py.

    Returns:
      ``(state, history)``: the last `TrainState` and a list of each step's metrics (Python floats; numpy for a
      non-scalar).
    """
    import numpy as np

    from revtrain.placement import global_batch
    mesh = trainer.mesh if mesh is None else mesh
    state, history = trainer.init(), []
    for batch in batches:
        state, metrics = trainer.train_step(state, global_batch(batch, mesh))
        history.append({k: float(v) if np.ndim(v) == 0 else np.asarray(v) for k, v in metrics.items()})
    return state, history


def numpy_params(state):
    """A `TrainState`'s parameters, one tree per layer (stacked runs split), as numpy arrays."""
    import jax
    import numpy as np
    return jax.tree.map(np.asarray, state.per_layer().params)


def train_params(trainer, batches, mesh):
    """`train_steps`, then the parameters (`numpy_params`) and each step's loss.

    Returns:
      ``(params, losses)``: one numpy tree per layer, and a list of Python floats.
    """
    state, history = train_steps(trainer, batches, mesh)
    return numpy_params(state), [h["loss"] for h in history]


def train_model(trainer_cls, model, tx, batches, devices: int = 1, **kwargs):
    """`train_params` of ``trainer_cls(model, tx, mesh, seed=0, **kwargs)`` on a mesh of the first ``devices``
    devices."""
    import jax

    from revtrain.placement import make_mesh
    mesh = make_mesh(jax.devices()[:devices])
    return train_params(trainer_cls(model, tx, mesh, seed=0, **kwargs), batches, mesh)


def worst_leaf(a, b):
    """``(max|a - b| / max|a| of the leaf where it is largest, that leaf's path)`` over two trees of arrays of
    the same structure (``b``'s paths are not read); a leaf of zeros in ``a`` divides by 1e-30."""
    import jax
    import numpy as np
    from jax.tree_util import keystr, tree_flatten_with_path
    rows = [(float(np.abs(np.asarray(x) - np.asarray(y)).max() / max(np.abs(np.asarray(x)).max(), 1e-30)),
             keystr(path)) for (path, x), y in zip(tree_flatten_with_path(a)[0], jax.tree.leaves(b))]
    return max(rows)


def rel_error(a, b) -> float:
    """``max|a - b| / max|b|`` of two arrays, computed in float64."""
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def run_worker(script: str, devices: int, out: pathlib.Path, *args, data_dir: str | None = None,
               timeout: float = 600) -> dict:
    """Runs a test module as a script on ``devices`` simulated CPU devices (``JAX_PLATFORMS=cpu``; a device
    count must be set before JAX starts, so tests that need several devices do their work in a child) and
    returns the JSON object it wrote to ``out``.

    Args:
      script: the module's path (its ``__file__``); it is called as ``script OUT *ARGS``.
      devices: ``--xla_force_host_platform_device_count``.
      out: where the script writes its JSON results.
      data_dir: ``REVTRAIN_DATA_DIR`` of the child.
      timeout: seconds.

    Raises:
      AssertionError: the script failed (the message ends with its stderr).
    """
    child = env(devices, data_dir, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.abspath(script), str(out), *map(str, args)], env=child,
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"worker failed (status {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(pathlib.Path(out).read_text())


def make_memory_cgroup(limit: int) -> pathlib.Path:
    """A new cgroup v1 memory group limited to ``limit`` bytes (root; ``/sys/fs/cgroup/memory``); the test is
    skipped where one cannot be made or the limit is not applied. The caller removes it (``rmdir``) when its
    processes are gone."""
    import pytest
    group = pathlib.Path("/sys/fs/cgroup/memory") / f"revtrain-test-{os.getpid()}-{os.urandom(3).hex()}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit))
        if int((group / "memory.limit_in_bytes").read_text()) > 2 * limit:
            raise OSError("limit not applied")
    except OSError as e:
        if group.exists():
            group.rmdir()
        pytest.skip(f"cannot make a cgroup v1 memory group: {e}")
    return group


def in_cgroup(group: pathlib.Path) -> list:
    """Command words that run the rest of a command line inside ``group`` (`revtrain`'s ``prefix``)."""
    return ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh"]
