"""Multi-host on one machine: two `revtrain train` processes (2 CPU devices each, gloo collectives over TCP on
127.0.0.1) follow the single-process 4-device run step for step.

One single-process run (4 devices, 5 steps) is the reference. The two-process run is started twice: first
with the command-line flags for 3 steps (checkpoint every 2 steps), then resumed to step 5 from the environment
(``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``). Its per-step losses must equal the
reference within 1e-5 relative, and only process 0 may write config, metrics and TensorBoard. Last, a
two-process ``revtrain eval --all`` scores the checkpoint that training did not evaluate.
"""

import re
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from helpers import CONFIG, env, free_port, records

TINY = ["--config", CONFIG,
        "--gin", "ReversibleTransformerLM.num_layers = 2", "--gin", "ReversibleTransformerLM.d_model = 32",
        "--gin", "train.batch_size = 8", "--gin", "train.log_every = 1", "--gin", "STEPS = 5", "--gin", "WARMUP = 2",
        "--gin", "evaluate.max_batches = 2", "--gin", "train.sample_every = 0",  # samples: test_sample.py
        # Dropout keys depend on each example's global index: equal losses then also show equal batch order.
        "--gin", "ReversibleTransformerLM.dropout_rate = 0.1"]
TIMEOUT = 300  # seconds for one run (both processes) on a slow, shared 2-core machine
# Each process's environment: helpers.env(isolated=True) drops launcher variables JAX would pick up on its own
# (a test run must not join some outer cluster).


class _Procs:
    """Started `revtrain` processes, each in its own session with its output in a file; `close` kills the
    ones still running (their whole process group), so a failed test leaves nothing behind."""

    def __init__(self, logdir: pathlib.Path):
        self.logdir = logdir
        self.procs: list[tuple[subprocess.Popen, pathlib.Path]] = []

    def start(self, name: str, args: list[str], env: dict) -> None:
        log = self.logdir / f"{name}.log"
        with open(log, "w") as f:
            proc = subprocess.Popen([sys.executable, "-m", "revtrain", *args], stdout=f, stderr=subprocess.STDOUT,
                                    env=env, cwd=self.logdir, start_new_session=True)
        self.procs.append((proc, log))

    def wait(self, timeout: float) -> list[tuple[int | None, str]]:
        """Waits for every process (killing all when one fails or time runs out): [(returncode, log)]."""
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p, _ in self.procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p, _ in self.procs):
                break  # a process failed: the other one would wait for it in a collective
            time.sleep(0.2)
        self.close()
        return [(p.returncode, log.read_text()) for p, log in self.procs]

    def close(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc, _ in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass


def _start_pair(procs: _Procs, name: str, workdir: pathlib.Path, extra: list[str], data_dir: str,
                via_env: bool) -> None:
    port = free_port()
    for i in range(2):
        if via_env:
            child = env(2, data_dir, isolated=True, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                        JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i))
            flags = []
        else:
            child = env(2, data_dir, isolated=True)
            flags = ["--coordinator_address", f"127.0.0.1:{port}", "--num_processes", "2", "--process_id", str(i)]
        procs.start(f"{name}.p{i}", ["train", *TINY, *extra, "--workdir", str(workdir), *flags], child)


def _check_ok(results, what: str) -> None:
    for i, (code, log) in enumerate(results):
        assert code == 0, f"{what}, process {i} exited {code}:\n{log[-4000:]}"


def _progress_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("step ")]


@pytest.fixture
def procs(tmp_path):
    p = _Procs(tmp_path)
    yield p
    p.close()


@pytest.mark.slow  # make test-all: three training processes
def test_two_processes_match_one_and_resume(tmp_path, procs, byte_lm_data_dir):
    single, multi = tmp_path / "single", tmp_path / "multi"

    # The reference and the first two-process run (3 of the 5 steps, checkpoint at 2 and 3) side by side.
    procs.start("single", ["train", *TINY, "--workdir", str(single)], env(4, byte_lm_data_dir, isolated=True))
    _start_pair(procs, "first", multi, ["--gin", "train.steps = 3", "--gin", "train.checkpoint_every = 2"],
                byte_lm_data_dir, via_env=False)
    results = procs.wait(TIMEOUT)
    _check_ok(results, "single-process run" if results[0][0] else "two-process run with flags")
    (_, single_log), (_, log0), (_, log1) = results

    # Only process 0 writes config, metrics, TensorBoard and progress lines; checkpoints hold both processes.
    assert sorted(p.name for p in multi.iterdir()) == [".lock", "checkpoints", "config.gin", "metrics", "tensorboard"]
    assert sorted(p.name for p in (multi / "metrics").iterdir()) == ["eval.jsonl", "train.jsonl"]
    assert len(list((multi / "tensorboard").iterdir())) == 1
    assert [len(_progress_lines(log0)), len(_progress_lines(log1))] == [3, 0], log1[-2000:]
    steps = sorted(int(p.name) for p in (multi / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [2, 3]
    for step in steps:
        data = sorted(p.name for p in (multi / "checkpoints" / str(step) / "data").glob("*.json"))
        assert data == ["process_0-of-2.json", "process_1-of-2.json"]

    # Resume the two-process run to step 5, started from JAX's environment variables this time.
    resume = _Procs(tmp_path)
    try:
        _start_pair(resume, "resume", multi, [], byte_lm_data_dir, via_env=True)
        results = resume.wait(TIMEOUT)
    finally:
        resume.close()
    _check_ok(results, "resumed two-process run (environment start)")
    assert "resumed from checkpoint at step 3" in results[0][1]
    assert not _progress_lines(results[1][1])

    reference, written = records(single), records(multi)
    assert [r["step"] for r in reference] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in written] == [1, 2, 3, 4, 5]  # written once, by process 0 only
    for want, got in zip(reference, written):
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (want["step"], want["loss"], got["loss"])
        assert (got["devices"], got["processes"]) == (4, 2)
        assert (want["devices"], want["processes"]) == (4, 1)
    assert [r["step"] for r in records(multi, "eval")] == [3, 5]
    assert abs(records(multi, "eval")[-1]["loss"] - records(single, "eval")[-1]["loss"]) <= 1e-5 * abs(
        records(single, "eval")[-1]["loss"])
    assert len(list((multi / "tensorboard").iterdir())) == 2  # one events file per run, both from process 0
    assert "4 device(s) in 2 process(es)" in results[0][1]

    # `revtrain eval --all` on two processes scores the one kept checkpoint not yet in eval.jsonl (step 2).
    evaluation = _Procs(tmp_path)
    try:
        port = free_port()
        for i in range(2):
            evaluation.start(f"eval.p{i}", ["eval", "--workdir", str(multi), "--all", "--coordinator_address",
                                            f"127.0.0.1:{port}", "--num_processes", "2", "--process_id", str(i)],
                             env(2, byte_lm_data_dir, isolated=True))
        results = evaluation.wait(TIMEOUT)
    finally:
        evaluation.close()
    _check_ok(results, "two-process eval")
    assert [r["step"] for r in records(multi, "eval")] == [3, 5, 2]
    assert "eval at step 2" in results[0][1] and "eval at step" not in results[1][1]


# -- how a command decides to join a multi-process run (no processes started) --------------------------------

_CLEAN = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID", "SLURM_STEP_NODELIST",
          "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE")


@pytest.mark.parametrize("env, expected", [
    ({}, None),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, "jax"),
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
      "SLURM_LOCALID": "0"}, "slurm"),
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
      "SLURM_LOCALID": "0"}, None),  # one task: a plain run that keeps every local device
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}, None),  # an allocation, not an srun step
    ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:5", "OMPI_COMM_WORLD_SIZE": "2"}, "ompi"),
    ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:5", "OMPI_COMM_WORLD_SIZE": "1"}, None),
])
def test_cluster_detection_from_the_environment(monkeypatch, env, expected):
    from revtrain import cli
    for k in _CLEAN:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli._cluster_from_env() == expected


@pytest.mark.parametrize("argv, env, message", [
    (["--coordinator_address", "127.0.0.1:1"], {}, "needs all of --coordinator_address"),
    (["--coordinator_address", "127.0.0.1:1", "--num_processes", "2", "--process_id", "2"], {}, "not in [0, 2)"),
    (["--coordinator_address", "nohost", "--num_processes", "2", "--process_id", "0"], {}, "HOST:PORT"),
    ([], {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, "need JAX_COORDINATOR_ADDRESS"),
    ([], {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "5"},
     "JAX_PROCESS_ID 5 is not in [0, 2)"),
    ([], {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "two"}, "must be an integer"),
])
def test_bad_multihost_settings_are_usage_errors(monkeypatch, argv, env, message):
    from revtrain import cli
    for k in _CLEAN:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    args = cli.parse_args(["train", "--workdir", "w", *argv])
    with pytest.raises(cli.UsageError, match=re.escape(message)):
        cli._init_distributed(args)


def test_platform_is_decided_without_starting_a_backend():
    import jax

    from revtrain import cli
    from revtrain.lifecycle import lost_peer
    started, before = lost_peer.backends_started(), jax.config.jax_platforms
    assert started is not None  # this JAX says (the guarded private query is there)
    try:
        jax.config.update("jax_platforms", "cpu")
        assert cli._platform_is_cpu()
        jax.config.update("jax_platforms", "cuda,cpu")
        assert not cli._platform_is_cpu()
    finally:
        jax.config.update("jax_platforms", before)
    assert lost_peer.backends_started() == started


def test_without_jax_private_hooks_multihost_start_falls_back(monkeypatch):
    """On a JAX without the private hooks (`lost_peer._private` finds nothing): `backends_started` cannot
    say, `initialize` still calls ``jax.distributed.initialize`` (no heartbeat callback) and takes the
    process id and count from its arguments, and the CLI turns JAX's own "called too late" error into its
    one-line usage error."""
    import jax

    from revtrain import cli
    from revtrain.lifecycle import lost_peer
    monkeypatch.setattr(lost_peer, "_private", lambda module, name: None)
    monkeypatch.setattr(lost_peer, "_install_terminate_handler", lambda: False)
    monkeypatch.setattr(lost_peer, "_state", dict(lost_peer._state))
    assert lost_peer.backends_started() is None
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    lost_peer.initialize(heartbeat_timeout=7, coordinator_address="127.0.0.1:1", num_processes=3, process_id=2)
    assert calls == [{"heartbeat_timeout_seconds": 7, "coordinator_address": "127.0.0.1:1", "num_processes": 3,
                      "process_id": 2}]
    assert (lost_peer._state["process"], lost_peer._state["processes"], lost_peer._state["active"]) == (2, 3, True)

    def too_late(**kw):
        raise RuntimeError("jax.distributed.initialize() must be called before any JAX calls that might "
                           "initialise the XLA backend.")

    monkeypatch.setattr(jax.distributed, "initialize", too_late)
    for k in _CLEAN:
        monkeypatch.delenv(k, raising=False)
    args = cli.parse_args(["train", "--workdir", "w", "--coordinator_address", "127.0.0.1:1", "--num_processes", "2",
                           "--process_id", "0"])
    monkeypatch.setenv("JAX_CPU_COLLECTIVES_IMPLEMENTATION", "gloo")  # leave this process's config alone
    with pytest.raises(cli.UsageError, match="JAX backends were started before jax.distributed.initialize"):
        cli._init_distributed(args)
