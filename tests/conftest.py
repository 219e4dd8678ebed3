"""Shared fixtures: the prepared byte-level dataset used by the trainer tests; one JAX compilation cache
for the whole test session."""

import os
import shutil
import tempfile
import time

import numpy as np
import pytest

_CACHE_SETTINGS = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def pytest_configure(config):
    """The tests compile the same programs many times over (the same tiny models, in this process, in the
    other xdist worker and in the revtrain subprocesses the CLI tests start): JAX's persistent compilation
    cache in a fresh directory for the session makes each compile once. The controller makes the directory;
    its workers and every subprocess inherit it through the environment (set before anything imports JAX).
    A cache hit runs the same executable, so no result changes; tests that need a cold compile (a signal
    during the first compile) set their own directory. The CLI's own cache (`revtrain.compile_cache`) yields to
    this one. ``REVTRAIN_TEST_COMPILE_CACHE=0`` turns both off."""
    if os.environ.get("REVTRAIN_TEST_COMPILE_CACHE", "1") == "0":
        os.environ["REVTRAIN_COMPILE_CACHE"] = "off"  # (nor the CLI's own, `revtrain.compile_cache`)
        return
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    directory = tempfile.mkdtemp(prefix="revtrain-test-xla-cache-")
    os.environ.update(JAX_COMPILATION_CACHE_DIR=directory, **_CACHE_SETTINGS)
    config._revtrain_compile_cache = directory


def pytest_unconfigure(config):
    directory = getattr(config, "_revtrain_compile_cache", None)
    if directory:
        shutil.rmtree(directory, ignore_errors=True)

# make test's longest files, longest first (CPU seconds of their make-test tests, `REVTRAIN_TEST_CPU`, in make test
# on 2026-12-06 after the cut to make test-all: 87 .. 25; the other files take 22 s or less). `make test` hands
# files to its two processes in collection order (``--dist loadfile --no-loadscope-reorder``): longest first, the
# short ones last fill the gap between the two, where xdist's own order (most tests first) left a long file of few
# tests to the end while the other process sat idle (about 50 s of 625 in a replay of the measured times).
LONGEST_FIRST = ("test_disk_tier.py", "test_exactness.py", "test_streaming.py", "test_memory_plan.py",
                 "test_smoke.py", "test_planning_runs.py", "test_modes.py", "test_optimizer_catalogue.py",
                 "test_parallel.py", "test_sample.py", "test_planning_costs.py", "test_recipe.py", "test_shard.py",
                 "test_layerwise.py", "test_check_optimizer.py", "test_cli.py", "test_budget.py",
                 "test_exact_residual.py", "test_revnet.py", "test_planning_auto.py", "test_reliability.py",
                 "test_combinations.py")


def pytest_collection_modifyitems(config, items):
    """Orders the collected tests file by file as `LONGEST_FIRST` (the other files after, in their own order;
    a file's tests keep theirs). Every xdist worker collects the same order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its children that have been waited for."""
    import resource
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


# JAX's own monitoring events (`jax.monitoring`) this process's compiles report: seconds of tracing, of lowering
# to XLA's module and of XLA's compile (or of fetching it from the persistent cache), and the persistent cache's
# hits and misses. Summed per test into the ``REVTRAIN_TEST_CPU`` record.
_JAX_DURATIONS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
                  "/jax/core/compile/backend_compile_duration": "compile_s"}
_JAX_EVENTS = {"/jax/compilation_cache/cache_hits": "cache_hits", "/jax/compilation_cache/cache_misses": "cache_misses"}
_compiling = {**dict.fromkeys(_JAX_DURATIONS.values(), 0.0), **dict.fromkeys(_JAX_EVENTS.values(), 0)}


def _listen_to_compiles() -> None:
    """Registers (once per process) the listeners that add JAX's compile events up in `_compiling`."""
    if getattr(_listen_to_compiles, "done", False):
        return
    import jax.monitoring

    def duration(event, seconds, **_):
        if event in _JAX_DURATIONS:
            _compiling[_JAX_DURATIONS[event]] += seconds

    def count(event, **_):
        if event in _JAX_EVENTS:
            _compiling[_JAX_EVENTS[event]] += 1

    jax.monitoring.register_event_duration_secs_listener(duration)
    jax.monitoring.register_event_listener(count)
    _listen_to_compiles.done = True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ``REVTRAIN_TEST_CPU=FILE``: each test's CPU seconds (setup, call and teardown; this process and the
    subprocesses it ran), appended to FILE as JSON lines ``{"test": node id, "cpu_s": ..., "wall_s": ...,
    "start": ..., "worker": ...}``: its wall seconds, when it started (seconds since the epoch) and the xdist
    worker that ran it (``gw0``, ``gw1``; ``main`` without xdist), from which a run's schedule is read back
    (`scripts/replay_test_schedule.py`). On a machine shared with other work a test's wall time says little (the
    `--durations` of one run swing by 2x or more); its CPU seconds are what it costs a test process, and about
    its wall time on an idle core. Each record also holds what this test process spent compiling (`_JAX_DURATIONS`:
    ``trace_s``, ``lower_s``, ``compile_s``, seconds, a cache hit's fetch counted as its compile) and the
    persistent cache's ``cache_hits`` and ``cache_misses`` (subprocesses not counted)."""
    path = os.environ.get("REVTRAIN_TEST_CPU")
    if path:
        _listen_to_compiles()
    start, wall, before = (_cpu_seconds(), time.time(), dict(_compiling)) if path else (0.0, 0.0, {})
    yield
    if path:
        import json
        record = {"test": item.nodeid, "cpu_s": round(_cpu_seconds() - start, 2),
                  "wall_s": round(time.time() - wall, 2), "start": round(wall, 2),
                  "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                  **{k: round(v - before[k], 3) for k, v in _compiling.items()}}
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


SEQUENCE_LENGTH = 128


@pytest.fixture(scope="session")
def byte_lm_data_dir():
    """The data dir holding the prepared ``gensim_enwiki`` byte-LM dataset (sequence length 128).

    Prepares it on first use, as ``scripts/prepare_data.py`` does (downloads the gensim wheel with pip
    when it is not cached), so a fresh CI machine needs no separate step.
    """
    from revtrain.data import byte_lm

    data_dir = byte_lm.default_data_dir()
    try:
        byte_lm.ensure_gensim_wheel(data_dir)
        byte_lm.load_byte_lm(byte_lm.GENSIM_SOURCE, SEQUENCE_LENGTH, data_dir)
    except byte_lm.DataError as e:
        pytest.fail(f"cannot prepare the byte-LM dataset: {e}")
    return data_dir


@pytest.fixture(scope="session")
def text_batches(byte_lm_data_dir):
    """A function ``(batch_size, count, seed=0) -> list`` of ``count`` training batches of real text.

    Each batch is ``{'inputs', 'targets'}``, int32 numpy ``[batch_size, 128]``.
    """
    from revtrain.data import byte_lm, pipeline

    builder = byte_lm.load_byte_lm(byte_lm.GENSIM_SOURCE, SEQUENCE_LENGTH, byte_lm_data_dir)

    def load(batch_size: int, count: int, seed: int = 0) -> list:
        it = iter(pipeline.train_dataset(builder, batch_size=batch_size, seed=seed))
        return [{k: np.asarray(v) for k, v in next(it).items()} for _ in range(count)]

    return load


@pytest.fixture
def tiny_model():
    """The tests' tiny model, as a factory (`helpers.tiny_model`): ``tiny_model()`` is a 2-block
    `ReversibleTransformerLM` of width 32 on 128-byte sequences; ``tiny_model(num_layers=4, sequence_length=16)``
    and the like for a test that needs another size. A fresh model per call (models are cheap; their compiled
    programs are shared through JAX's caches)."""
    from helpers import tiny_model as make
    return make


@pytest.fixture
def train_steps():
    """``train_steps(trainer, batches, mesh=None) -> (state, history)`` (`helpers.train_steps`): one
    ``train_step`` per host batch from ``trainer.init()``, each step's metrics as Python floats."""
    from helpers import train_steps as run
    return run
