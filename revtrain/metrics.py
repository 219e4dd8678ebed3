"""Metric outputs: JSONL files, TensorBoard events (tensorboardX) and the progress line.

Only process 0 writes (other processes get a writer that does nothing). Files:
``DIR/metrics/train.jsonl`` and ``DIR/metrics/eval.jsonl`` (one JSON object a line, each with ``"step"``),
and ``DIR/tensorboard/`` (scalars under ``train/...`` and ``eval/...``).
"""

from __future__ import annotations

import json
import math
import os
import sys

import jax


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricWriter:
    """Appends metrics to JSONL and TensorBoard. Values are Python floats/ints/strings.

    Args:
      workdir: run directory.
      enabled: write anything at all (False on processes other than 0).
    """

    def __init__(self, workdir: str, enabled: bool = True):
        self.enabled = enabled
        self._tb = None
        self.metrics_dir = os.path.join(workdir, "metrics")
        self.tb_dir = os.path.join(workdir, "tensorboard")
        if enabled:
            os.makedirs(self.metrics_dir, exist_ok=True)

    def _board(self):
        if self._tb is None:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(self.tb_dir, flush_secs=10)
        return self._tb

    def write(self, kind: str, step: int, values: dict) -> None:
        """Appends ``{"step": step, **values}`` to ``metrics/<kind>.jsonl`` and numeric values to TensorBoard."""
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _clean(v) for k, v in values.items()}}
        with open(os.path.join(self.metrics_dir, f"{kind}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        board = self._board()
        for k, v in values.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                board.add_scalar(f"{kind}/{k}", v, int(step))

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_jsonl(path: str) -> list[dict]:
    """Reads a metrics file: a list of dicts (empty when the file does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def progress_line(step: int, total: int, values: dict, eta_seconds: float, unit: str = "tok") -> str:
    """One human-readable progress line (step/total, loss, bits per byte, lr, rates, ETA).

    ``unit`` names what ``tokens_per_sec`` counts ("tok" for language models, "ex" for examples)."""
    parts = [f"step {step}/{total}", f"loss {values['loss']:.4f}"]
    if "bits_per_byte" in values:
        parts.append(f"bpb {values['bits_per_byte']:.3f}")
    lr = values.get("learning_rate")
    if lr is not None and math.isfinite(lr):
        parts.append(f"lr {lr:.3g}")
    parts.append(f"{values['steps_per_sec']:.2f} steps/s")
    parts.append(f"{values['tokens_per_sec']:,.0f} {unit}/s")
    if values.get("peak_device_bytes"):
        parts.append(f"peak {values['peak_device_bytes'] / 2**20:.1f} MiB")
    parts.append(f"ETA {_duration(eta_seconds)}")
    return " | ".join(parts)


def log(line: str, enabled: bool = True) -> None:
    """Prints one line to stderr (process 0 only)."""
    if enabled and jax.process_index() == 0:
        print(line, file=sys.stderr, flush=True)
