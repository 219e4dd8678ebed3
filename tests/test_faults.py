"""Faults past a single training process: a lost host, signals in eval / sample / check, signal bursts and an
empty data source. Each case checks the exit status, the one line on stderr, the time it took where the
time is bounded, and the files left behind.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
CONFIG = str(REPO / "configs" / "enwik_small.gin")
TINY = ["--config", CONFIG, "--gin", "ReversibleTransformerLM.num_layers = 1",
        "--gin", "ReversibleTransformerLM.d_model = 16", "--gin", "ReversibleTransformerLM.num_heads = 1",
        "--gin", "train.batch_size = 2", "--gin", "evaluate.max_batches = 1", "--gin", "train.log_every = 1",
        "--gin", "WARMUP = 1", "--gin", "train.sample_every = 0"]
_LAUNCHER_PREFIXES = ("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS", "SLURM_",
                      "OMPI_", "PMI_", "XLA_FLAGS", "JAX_PLATFORMS")


HEARTBEAT = 5  # --heartbeat_timeout of the two-process runs, seconds
_CACHE = {}


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    """The subprocesses share JAX's persistent compilation cache (a fresh directory): each compiles the
    same tiny programs otherwise, which is most of their time (the cache changes no result)."""
    _CACHE.update(JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("xla_cache")),
                  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    yield
    _CACHE.clear()


def _env(data_dir: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", REVTRAIN_DATA_DIR=data_dir, **_CACHE)
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _records(workdir: pathlib.Path) -> dict:
    path = workdir / "metrics" / "train.jsonl"
    return {r["step"]: r for r in (json.loads(l) for l in path.read_text().splitlines() if l.strip())}


def _pair(workdir, steps, data_dir, logdir, name):
    """Starts a two-process run (one CPU device each, gloo); returns the two Popen objects and logs."""
    port = _free_port()
    procs = []
    for i in range(2):
        log = open(logdir / f"{name}.p{i}.log", "w+")
        cmd = [sys.executable, "-m", "revtrain", "train", *TINY, "--gin", f"STEPS = {steps}",
               "--gin", "train.checkpoint_every = 5", "--workdir", str(workdir), "--coordinator_address",
               f"127.0.0.1:{port}", "--num_processes", "2", "--process_id", str(i), "--heartbeat_timeout", str(HEARTBEAT)]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(data_dir),
                                       start_new_session=True), log))
    return procs


def _read(log) -> str:
    log.flush()
    return pathlib.Path(log.name).read_text()


def _kill_all(procs):
    for p, _ in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)


@pytest.mark.parametrize("lost", [1, 0])
def test_a_lost_process_stops_the_other_with_one_line_and_the_run_resumes_exactly(tmp_path, lost, byte_lm_data_dir):
    """kill -9 of one process at step 12 of a two-process run: the other prints one line naming the lost
    process and the newest checkpoint and exits 1 within the heartbeat timeout (5 s here), with no C++
    trace; the same command on both processes then resumes, and its steps after the checkpoint equal the
    first run's bit for bit."""
    workdir = tmp_path / "run"
    procs = _pair(workdir, 15, byte_lm_data_dir, tmp_path, "first")
    try:
        deadline = time.monotonic() + 240
        while "step 12/15" not in _read(procs[0][1]):
            assert time.monotonic() < deadline and all(p.poll() is None for p, _ in procs), _read(procs[0][1])
            time.sleep(0.05)
        os.killpg(procs[lost][0].pid, signal.SIGKILL)
        killed = time.monotonic()
        survivor, log = procs[1 - lost]
        code = survivor.wait(timeout=60)
        seconds = time.monotonic() - killed
    finally:
        _kill_all(procs)
    before = _records(workdir)
    out = _read(log).splitlines()
    errors = [l for l in out if "error" in l.lower() or "Check failure" in l or "coordination" in l.lower()]
    steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert code == 1, out[-20:]
    assert seconds < HEARTBEAT + 5, seconds
    who = "process 1 of 2" if lost == 1 else "process 0 of 2, the coordinator,"
    assert len(errors) == 1 and errors[0].startswith(f"revtrain: error: lost {who} ("), out[-20:]
    assert out[-1] == errors[0] and f"the newest checkpoint (step {steps[-1]}) is kept; start the same command " \
        "on every host to resume" in errors[0], out[-20:]
    assert steps[-1] in (5, 10)  # (step 10's save may not have finished on both processes)

    procs = _pair(workdir, 15, byte_lm_data_dir, tmp_path, "resume")
    try:
        codes = [p.wait(timeout=240) for p, _ in procs]
    finally:
        _kill_all(procs)
    assert codes == [0, 0], _read(procs[0][1])[-3000:] + _read(procs[1][1])[-3000:]
    assert f"resumed from checkpoint at step {steps[-1]}" in _read(procs[0][1])
    after = _records(workdir)
    assert sorted(after) == list(range(1, 16))
    redone = [s for s in before if s > steps[-1]]
    assert redone, (steps, sorted(before))
    for s in redone:  # the same losses, bit for bit, as before the loss of the process
        assert after[s]["loss"] == before[s]["loss"], (s, before[s]["loss"], after[s]["loss"])
    assert all(n.isdigit() for n in os.listdir(workdir / "checkpoints")), os.listdir(workdir / "checkpoints")


@pytest.mark.parametrize("kind", ["empty file", "empty directory", "too small"])
def test_an_unusable_data_source_prints_only_the_error_and_leaves_no_cache(tmp_path, capfd, kind):
    from revtrain import cli
    source = tmp_path / "corpus"
    if kind == "empty directory":
        source.mkdir()
    else:
        source.write_bytes(b"" if kind == "empty file" else b"tiny corpus")
    data_dir, workdir = tmp_path / "cache", tmp_path / "run"
    code = cli.main(["train", *TINY, "--gin", f"ByteLMTask.source = '{source}'", "--gin",
                     f"ByteLMTask.data_dir = '{data_dir}'", "--workdir", str(workdir)])
    captured = capfd.readouterr()
    lines = [l for l in (captured.out + captured.err).splitlines() if l.strip()]
    want = {"empty file": "is empty (file is empty)", "empty directory": "is empty (directory has no non-empty "
            "text files)", "too small": "sequence length 128 is too large: the train split has only"}[kind]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("revtrain: error: ") and want in lines[0], lines
    assert not workdir.exists()
    assert not data_dir.exists() or not any(data_dir.rglob("*")), sorted(data_dir.rglob("*"))
