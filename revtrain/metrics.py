"""Metric outputs: JSONL files, TensorBoard events (tensorboardX) and the progress line.

Only process 0 writes (other processes get a writer that does nothing). Files:
``DIR/metrics/train.jsonl`` and ``DIR/metrics/eval.jsonl`` (one JSON object a line, each with ``"step"``),
and ``DIR/tensorboard/`` (scalars under ``train/...`` and ``eval/...``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys

import jax

from revtrain.errors import RunFailure


class MetricsWriteError(RunFailure, OSError):
    """A metrics file could not be written (disk full, quota, I/O error); ``errno`` is the OS error's."""

    def __str__(self):
        return self.strerror or super().__str__()


def _drop_partial_line(path: str) -> None:
    """Cuts a last line that a failed write (disk full, kill) left without its newline, so that appended
    records stay one JSON object a line. Reads only the file's tail."""
    try:
        with open(path, "rb+") as f:
            end = f.seek(0, os.SEEK_END)
            if end == 0:
                return
            f.seek(end - 1)
            if f.read(1) == b"\n":
                return
            pos = end
            while pos > 0:
                start = max(0, pos - (1 << 16))
                f.seek(start)
                cut = f.read(pos - start).rfind(b"\n")
                if cut >= 0:
                    f.truncate(start + cut + 1)
                    return
                pos = start
            f.truncate(0)
    except FileNotFoundError:
        pass


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
        self._purge_step: int | None = None
        self.metrics_dir = os.path.join(workdir, "metrics")
        self.tb_dir = os.path.join(workdir, "tensorboard")
        if enabled:
            os.makedirs(self.metrics_dir, exist_ok=True)
            for kind in ("train", "eval", "samples"):
                _drop_partial_line(os.path.join(self.metrics_dir, f"{kind}.jsonl"))

    def _board(self):
        if self._tb is None:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(self.tb_dir, flush_secs=10, purge_step=self._purge_step)
        return self._tb

    def restart_at(self, step: int) -> None:
        """Continues the metrics of a run resumed from ``step`` (0: a run starting over): drops every record
        of a later step from each ``metrics/*.jsonl`` (the run redoes those steps, so each step appears
        once), and has TensorBoard hide the older events files' events after ``step`` (its purge step).

        Raises:
          MetricsWriteError: a file could not be rewritten (it is left as it was).
        """
        if not self.enabled:
            return
        self._purge_step = step + 1
        for name in sorted(os.listdir(self.metrics_dir)):
            path = os.path.join(self.metrics_dir, name)
            if not name.endswith(".jsonl") or not os.path.isfile(path):
                continue
            _drop_records(path, lambda r: isinstance(r.get("step"), int) and r["step"] > step)

    def forget(self, kind: str, step: int) -> None:
        """Drops the records of ``step`` from ``metrics/<kind>.jsonl`` (a checkpoint scored again replaces
        its record, so each step appears once).

        Raises:
          MetricsWriteError: the file could not be rewritten (it is left as it was).
        """
        if self.enabled:
            _drop_records(os.path.join(self.metrics_dir, f"{kind}.jsonl"), lambda r: r.get("step") == step)

    def write(self, kind: str, step: int, values: dict) -> None:
        """Appends ``{"step": step, **values}`` to ``metrics/<kind>.jsonl`` and numeric values to TensorBoard.

        Raises:
          MetricsWriteError: the file system refused the write (the message names the file).
        """
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _clean(v) for k, v in values.items()}}
        path = os.path.join(self.metrics_dir, f"{kind}.jsonl")
        try:
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            raise MetricsWriteError(e.errno, f"cannot write {path}: {e.strerror or e}") from e
        board = self._board()
        for k, v in values.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                board.add_scalar(f"{kind}/{k}", v, int(step))

    def add_text(self, tag: str, text: str, step: int) -> None:
        """Adds ``text`` (Markdown) to TensorBoard under ``tag`` at ``step`` (tensorboardX ``add_text``)."""
        if self.enabled:
            self._board().add_text(tag, text, int(step))

    def flush(self) -> None:
        """Writes buffered TensorBoard events. Raises `MetricsWriteError` when the file system refuses."""
        if self._tb is not None:
            try:
                self._tb.flush()
            except OSError as e:
                raise MetricsWriteError(e.errno, f"cannot write {self.tb_dir}: {e.strerror or e}") from e

    def close(self) -> None:
        """Flushes and closes TensorBoard's event file (see `flush` for errors)."""
        if self._tb is not None:
            tb, self._tb = self._tb, None
            try:
                tb.close()
            except OSError as e:
                raise MetricsWriteError(e.errno, f"cannot write {self.tb_dir}: {e.strerror or e}") from e

    def abandon(self) -> None:
        """Drops TensorBoard's buffered events without writing them (after a failed write: the disk is
        full, and tensorboardX would otherwise retry from a background thread and at exit)."""
        if self._tb is not None:
            tb, self._tb = self._tb, None
            for writer in (tb.all_writers or {}).values():
                events = writer.event_writer
                # tensorboardX has no public discard: stop its writer thread here (it writes what is
                # queued, fails on the full disk and ends), then mark the writer closed so that neither
                # close() nor its exit handler tries to flush again.
                worker = events._worker  # noqa: SLF001
                if worker is not None and worker.is_alive():
                    events._event_queue.put(worker._shutdown_signal)  # noqa: SLF001
                    worker.join(timeout=10)
                events._closed = True  # noqa: SLF001
            tb.close()


def _drop_records(path: str, drop) -> None:
    """Rewrites the metrics file ``path`` without the records for which ``drop(record)`` is true (atomically:
    a temporary file replaces it; nothing is written when no record is dropped or the file is missing).

    Raises:
      MetricsWriteError: the file could not be rewritten (it is left as it was).
    """
    records = read_jsonl(path)
    kept = [r for r in records if not drop(r)]
    if len(kept) == len(records):
        return
    try:
        with open(path + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(path + ".tmp", path)
    except OSError as e:
        raise MetricsWriteError(e.errno, f"cannot write {path}: {e.strerror or e}") from e


def read_jsonl(path: str) -> list[dict]:
    """Reads a metrics file: a list of dicts (empty when the file does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")
    # A last line without its newline was cut short by a failed write: not a record.
    return [json.loads(line) for line in lines[:-1] if line.strip()]


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def progress_line(step: int, total: int, values: dict, eta_seconds: float | None, unit: str = "tok") -> str:
    """One human-readable progress line (step/total, loss, bits per byte, lr, rates, ETA).

    ``unit`` names what ``tokens_per_sec`` counts ("tok" for language models, "ex" for examples); no ETA where
    ``eta_seconds`` is None (a process's first line, whose interval holds the compile)."""
    tokens = "bytes_per_token" in values  # a subword run: the loss is per token, bpb at the mean bytes/token
    parts = [f"step {step}/{total}", f"loss {values['loss']:.4f}" + (" nats/token" if tokens else "")]
    if "bits_per_byte" in values:
        parts.append(f"bpb {values['bits_per_byte']:.3f}"
                     + (f" (at {values['bytes_per_token']:.2f} bytes/token)" if tokens else ""))
    if "grad_norm" in values:
        parts.append(f"grad norm {values['grad_norm']:.3g}")
    lr = values.get("learning_rate")
    if lr is not None and math.isfinite(lr):
        parts.append(f"lr {lr:.3g}")
    parts.append(f"{values['steps_per_sec']:.2f} steps/s")
    parts.append(f"{values['tokens_per_sec']:,.0f} {unit}/s")
    if values.get("peak_device_bytes"):
        parts.append(f"peak {values['peak_device_bytes'] / 2**20:.1f} MiB")
    if values.get("host_state_bytes"):
        parts.append(f"host state {values['host_state_bytes'] / 2**20:.1f} MiB/device")
    if values.get("host_resident_bytes"):
        parts.append(f"host RSS {values['host_resident_bytes'] / 2**20:,.0f} MiB (peak "
                     f"{values.get('host_peak_bytes', 0) / 2**20:,.0f})")
    if eta_seconds is not None:
        parts.append(f"ETA {_duration(eta_seconds)}")
    return " | ".join(parts)


def eval_text(result: dict) -> str:
    """An evaluation's scores as ``name value`` pairs; a subword run's loss is marked as nats per token."""
    unit = {"loss": " (nats/token)"} if "bytes_per_token" in result else {}
    return ", ".join(f"{k}{unit.get(k, '')} {v:.4f}" for k, v in result.items())


_SILENT = [0]  # > 0 inside `silenced`


# Libraries whose warnings a command silences for good (`revtrain.cli`) and a library call only inside
# `silenced` (Orbax's read-only checkpoint manager warns through absl on every restore).
_CHATTY_LOGGERS = ("absl", "orbax")


@contextlib.contextmanager
def silenced():
    """Within the block `log` prints nothing and the absl / Orbax loggers only errors: a library call
    (``revtrain.logits.load``) restores a checkpoint and builds a run's trainer without the lines a command
    prints. Errors are raised as always; the loggers' levels are restored afterwards."""
    import logging
    loggers = [logging.getLogger(name) for name in _CHATTY_LOGGERS]
    levels = [lg.level for lg in loggers]
    _SILENT[0] += 1
    for lg in loggers:
        lg.setLevel(max(lg.getEffectiveLevel(), logging.ERROR))
    try:
        yield
    finally:
        _SILENT[0] -= 1
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def log(line: str, enabled: bool = True, result: bool = False) -> None:
    """Prints one line to stderr (process 0 only; nothing inside `silenced`); ``result``: to stdout instead, a
    line that is the command's own result (`revtrain eval`'s scores), which a pipe or a redirect keeps apart
    from the progress and notes on stderr."""
    if enabled and not _SILENT[0] and jax.process_index() == 0:
        print(line, file=sys.stdout if result else sys.stderr, flush=True)
