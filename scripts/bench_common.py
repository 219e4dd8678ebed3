"""What the benchmarks of scripts/bench_trainers.py, bench_depth.py, bench_seq.py and bench_shard.py share:
building a trainer, real batches on the mesh, waiting for a step, timing configurations in interleaved
rounds, peak device bytes measured in a fresh process, and writing the JSON / PNG outputs. Not a script.

Importing it also puts the repository on ``sys.path`` when ``revtrain`` is not installed, so each benchmark
imports it first: ``import bench_common as common`` (the script's own folder is on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

try:
    import revtrain  # noqa: F401
except ImportError:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import optax  # noqa: E402

from revtrain.data import byte_lm, pipeline  # noqa: E402
from revtrain.memory import MemoryMeter  # noqa: E402
from revtrain.placement import global_batch  # noqa: E402
from revtrain.trainers import ReversibleTrainer, StandardTrainer  # noqa: E402


def make_trainer(kind, model, mesh, tx=None, **kwargs):
    """``StandardTrainer`` (``kind == "standard"``) or ``ReversibleTrainer`` (any other kind) of ``model`` on
    ``mesh``, seed 0, optimizer ``tx`` (default ``optax.adam(1e-4)``), with the trainer's keyword arguments."""
    cls = StandardTrainer if kind == "standard" else ReversibleTrainer
    return cls(model, tx if tx is not None else optax.adam(1e-4), mesh, seed=0, **kwargs)


def batches(seq, batch, n, mesh) -> list:
    """``n`` real batches of ``batch`` x ``seq`` bytes (the English-Wikipedia excerpt, ``seed`` 0) placed on
    ``mesh`` (split along its data axis)."""
    builder = byte_lm.load_byte_lm(byte_lm.GENSIM_SOURCE, seq, byte_lm.default_data_dir())
    it = iter(pipeline.train_dataset(builder, batch_size=batch, seed=0))
    return [global_batch(next(it), mesh) for _ in range(n)]


def ready(ts, metrics) -> None:
    """Blocks until a step's state and metrics are computed. Waits on the arrays the trainer holds: the
    stacked layout as it is (``ts.params`` of a stacked state would copy every slice out, each step)."""
    jax.block_until_ready((ts.held(), metrics))


def timed_rounds(configs, trainers, states, batches, rounds, logged=False) -> dict:
    """Interleaved rounds: one step of each configuration per round (so machine noise hits all alike), on
    ``batches[round % len(batches)]``. Returns each configuration's step times in seconds. ``states`` is
    advanced in place. ``logged``: the memory meter (``trainers[c].meter``) measures every step, as on a
    logged step of the train loop."""
    times = {c: [] for c in configs}
    for r in range(rounds):
        b = batches[r % len(batches)]
        for c in configs:
            t = trainers[c]
            if logged:
                t.meter.start()
            t0 = time.perf_counter()
            states[c], m = t.train_step(states[c], b)
            ready(states[c], m)
            if logged:
                t.meter.stop()
            times[c].append(time.perf_counter() - t0)
    return times


def measure(configs, build, batches, rounds) -> dict:
    """Builds each configuration (``build(c)`` returns its trainer), times its first step (start-up: tracing,
    compilation, first run), gives it a memory meter (a metered second step compiles the meter's analyses),
    then times all of them in ``rounds`` interleaved rounds, unlogged and logged. Returns by configuration
    ``startup_s`` (seconds), ``step_s`` (median unlogged step, seconds), ``steps_per_sec`` and
    ``logged_over_unlogged`` (median logged / median unlogged step time)."""
    trainers, states, out = {}, {}, {}
    for c in configs:
        t0 = time.perf_counter()
        trainer = build(c)
        ts = trainer.init()
        ts, m = trainer.train_step(ts, batches[0])
        ready(ts, m)
        startup = time.perf_counter() - t0
        trainer.meter = MemoryMeter()
        trainer.meter.start()  # the meter's first look at each program compiles it for memory_analysis
        ts, m = trainer.train_step(ts, batches[1 % len(batches)])
        ready(ts, m)
        trainer.meter.stop()
        trainers[c], states[c] = trainer, ts
        out[c] = {"startup_s": startup}
    plain = timed_rounds(configs, trainers, states, batches, rounds, logged=False)
    logged = timed_rounds(configs, trainers, states, batches, rounds, logged=True)
    for c in configs:
        step = statistics.median(plain[c])
        out[c].update(step_s=step, steps_per_sec=1.0 / step,
                      logged_over_unlogged=statistics.median(logged[c]) / step)
    return out


def peak_in_subprocess(script, argv) -> tuple[int, str]:
    """Peak device bytes measured by ``python script *argv`` in a fresh process (an accelerator allocator's
    peak cannot be reset within a process): the script's last line of output is ``PEAK_BYTES METHOD``.
    Returns ``(bytes, memory meter method)``."""
    cmd = [sys.executable, str(script), *argv]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    peak, method = out.split()
    return int(peak), method


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only, no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def write_outputs(result, out, table, plot=None, png=None) -> None:
    """Writes ``result`` to ``out`` as JSON (indent 1), the plot ``plot(result, png)`` when given, prints
    ``table(result)`` and the paths written."""
    pathlib.Path(out).write_text(json.dumps(result, indent=1) + "\n")
    if plot is not None:
        plot(result, png)
    print(table(result))
    print(f"wrote {os.path.abspath(out)}" + (f" and {os.path.abspath(png)}" if plot is not None else ""))
