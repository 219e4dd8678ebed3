"""Finishes a ``revtrain train`` process stopped at once by a signal (see `revtrain.lifecycle.interrupts`).

Run through ``os.execv`` in place of that process (same PID, every other thread already gone), with one
argument: a JSON object ``{"message", "code", "checkpoints", "workdir", "primary", "report_checkpoints"}``. Deletes the
unfinished ``*.orbax-checkpoint-tmp*`` directories under ``checkpoints``; deletes ``workdir`` (given only
when the run created it) if it holds no complete checkpoint and no metrics record; prints ``revtrain: <message>; <the newest
checkpoint kept>`` (without it when ``report_checkpoints`` is false: eval, sample, check) on stderr and exits
with ``code``. Standard library only (started with ``python -I -S``).
"""

import json
import os
import shutil
import signal
import sys


def _has_records(metrics: str) -> bool:
    """Whether a metrics file has any record (then the workdir is kept, for the record)."""
    try:
        return any(n.endswith(".jsonl") and os.path.getsize(os.path.join(metrics, n)) for n in os.listdir(metrics))
    except OSError:
        return False


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the user asked to stop: let the cleanup finish
    spec = json.loads(argv[1])
    checkpoints, primary = spec.get("checkpoints"), spec.get("primary", True)
    steps = []
    if checkpoints and os.path.isdir(checkpoints):
        for name in os.listdir(checkpoints):
            if primary and ".orbax-checkpoint-tmp" in name:
                shutil.rmtree(os.path.join(checkpoints, name), ignore_errors=True)
        steps = sorted(int(name) for name in os.listdir(checkpoints) if name.isdigit())
    line = f"revtrain: {spec['message']}"
    if not spec.get("report_checkpoints", True):
        pass  # eval, sample, check: the message says it all
    elif steps:
        line += f"; the newest checkpoint (step {steps[-1]}) is kept"
    else:
        line += "; no checkpoint was written"
        workdir = spec.get("workdir")
        if workdir and primary and os.path.isdir(workdir) and not _has_records(os.path.join(workdir, "metrics")):
            shutil.rmtree(workdir, ignore_errors=True)
            line += f" (the workdir it created, {workdir}, is removed)"
    print(line, file=sys.stderr, flush=True)
    return int(spec["code"])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
