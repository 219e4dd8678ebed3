"""Times of the fault handling in docs/faults.md, measured as whole commands side by side in one run.

  python scripts/bench_faults.py [--rounds 2] [--depth 48] [--d_models 32,16] [--train_steps 3]
                                 [--heartbeat 10] [--out docs/faults.json]

* ``revtrain check`` at depth ``--depth`` (T 32, batch 4) against ``revtrain train`` of ``--train_steps`` steps
  on the same model, in interleaved rounds (check, train, check, train, ...): wall seconds of each
  command from start to exit, start-up and compilation included (that is what a user waits for), and
  their ratio per round.
* A lost process: a two-process run (one CPU device each, gloo) with ``--heartbeat_timeout``; at step 20
  one process is killed with SIGKILL; the seconds until the other exits, and its exit status and line,
  for process 1 lost and for process 0 (the coordinator) lost.

Writes a JSON record per measurement to ``--out`` and prints them.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
CONFIG = str(REPO / "configs" / "enwik_small.gin")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COORDINATOR", "XLA_FLAGS"))}
    env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    return env


def _model(depth: int, d_model: int) -> list[str]:
    return ["--config", CONFIG, "--gin", f"ReversibleTransformerLM.num_layers = {depth}", "--gin",
            f"ReversibleTransformerLM.d_model = {d_model}", "--gin", "ByteLMTask.sequence_length = 32",
            "--gin", "train.batch_size = 4", "--gin", "train.sample_every = 0", "--gin", "evaluate.max_batches = 1"]


def _timed(cmd: list[str]) -> tuple[float, int, str]:
    start = time.monotonic()
    result = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    last = (result.stdout.strip() or result.stderr.strip() or "-").splitlines()[-1]
    return time.monotonic() - start, result.returncode, last


def check_vs_train(depth: int, d_model: int, steps: int, rounds: int) -> list[dict]:
    records = []
    for r in range(rounds):
        with tempfile.TemporaryDirectory() as tmp:
            check = _timed([sys.executable, "-m", "revtrain", "check", *_model(depth, d_model)])
            train = _timed([sys.executable, "-m", "revtrain", "train", *_model(depth, d_model), "--gin",
                            f"STEPS = {steps}", "--gin", "WARMUP = 1", "--gin", f"train.log_every = {steps}",
                            "--workdir", os.path.join(tmp, "run")])
        rec = {"what": "check vs train", "depth": depth, "d_model": d_model, "round": r,
               "check_seconds": round(check[0], 1), "check_exit": check[1], "check_verdict": check[2],
               f"train_{steps}_steps_seconds": round(train[0], 1), "train_exit": train[1],
               "ratio": round(check[0] / train[0], 2)}
        print(json.dumps(rec), flush=True)
        records.append(rec)
    return records


def lost_process(lost: int, heartbeat: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i in range(2):
            log = open(os.path.join(tmp, f"p{i}.log"), "w+")
            cmd = [sys.executable, "-m", "revtrain", "train", *_model(2, 16), "--gin", "STEPS = 1000", "--gin",
                   "WARMUP = 1", "--gin", "train.log_every = 1", "--gin", "train.checkpoint_every = 5",
                   "--workdir", os.path.join(tmp, "run"), "--coordinator_address", f"127.0.0.1:{port}",
                   "--num_processes", "2", "--process_id", str(i), "--heartbeat_timeout", str(heartbeat)]
            procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(),
                                           start_new_session=True), log))
        try:
            while "step 20/" not in pathlib.Path(procs[0][1].name).read_text():
                time.sleep(0.05)
            os.killpg(procs[lost][0].pid, signal.SIGKILL)
            killed = time.monotonic()
            code = procs[1 - lost][0].wait(timeout=heartbeat + 120)
            seconds = time.monotonic() - killed
        finally:
            for p, _ in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        line = pathlib.Path(procs[1 - lost][1].name).read_text().strip().splitlines()[-1]
    rec = {"what": "lost process", "lost": lost, "heartbeat_timeout": heartbeat, "survivor_exit": code,
           "seconds_to_exit": round(seconds, 2), "line": line}
    print(json.dumps(rec), flush=True)
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--depth", type=int, default=48)
    p.add_argument("--d_models", default="32,16")
    p.add_argument("--train_steps", type=int, default=3)
    p.add_argument("--heartbeat", type=int, default=10)
    p.add_argument("--out", default=str(REPO / "docs" / "faults.json"))
    args = p.parse_args()
    records = []
    for d_model in [int(d) for d in args.d_models.split(",")]:
        records += check_vs_train(args.depth, d_model, args.train_steps, args.rounds)
    for lost in (1, 0):
        records.append(lost_process(lost, args.heartbeat))
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
