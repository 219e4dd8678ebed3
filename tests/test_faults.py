"""Faults past a single training process: a lost host, signals in eval / sample / check, signal bursts and an
empty data source. Each case checks the exit status, the one line on stderr, the time it took where the
time is bounded, and the files left behind.
"""

import json
import shutil
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

from helpers import CONFIG, REPO, env, free_port, records_by_step

TINY = ["--config", CONFIG, "--gin", "ReversibleTransformerLM.num_layers = 1",
        "--gin", "ReversibleTransformerLM.d_model = 16", "--gin", "ReversibleTransformerLM.num_heads = 1",
        "--gin", "train.batch_size = 2", "--gin", "evaluate.max_batches = 1", "--gin", "train.log_every = 1",
        "--gin", "WARMUP = 1", "--gin", "train.sample_every = 0"]


HEARTBEAT = 5  # --heartbeat_timeout of the two-process runs, seconds
_CACHE = {}


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    """The subprocesses share JAX's persistent compilation cache: each compiles the same tiny programs
    otherwise, which is most of their time (the cache changes no result). The test session's cache
    (tests/conftest.py) where there is one, also this process's: what a subprocess compiled, the commands run
    here find compiled, and the other way round; else a fresh directory for the module."""
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        _CACHE.update(JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("xla_cache")),
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    yield
    _CACHE.clear()


def _pair(workdir, steps, data_dir, logdir, name):
    """Starts a two-process run (one CPU device each, gloo); returns the two Popen objects and logs."""
    port = free_port()
    procs = []
    for i in range(2):
        log = open(logdir / f"{name}.p{i}.log", "w+")
        cmd = [sys.executable, "-m", "revtrain", "train", *TINY, "--gin", f"STEPS = {steps}",
               "--gin", "train.checkpoint_every = 5", "--workdir", str(workdir), "--coordinator_address",
               f"127.0.0.1:{port}", "--num_processes", "2", "--process_id", str(i), "--heartbeat_timeout", str(HEARTBEAT)]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                       env=env(data_dir=data_dir, isolated=True, **_CACHE)), log))
    return procs


def _read(log) -> str:
    log.flush()
    return pathlib.Path(log.name).read_text()


def _kill_all(procs):
    for p, _ in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)


def _lose_one(workdir, lost: int, data_dir: str, logdir) -> dict:
    """A two-process run (15 steps, checkpoint every 5) whose process ``lost`` is killed with SIGKILL at step
    12: the survivor's exit status, seconds from the kill to its exit, output, and the checkpoints left."""
    procs = _pair(workdir, 15, data_dir, logdir, f"first.lost{lost}")
    try:
        deadline = time.monotonic() + 400
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
    return {"code": code, "seconds": seconds, "out": _read(log).splitlines(), "records": records_by_step(workdir),
            "checkpoints": sorted(os.listdir(workdir / "checkpoints"))}


def _survivor_reported(r: dict, lost: int) -> int:
    """Checks the survivor's exit and line; returns the newest checkpoint step it names."""
    out = r["out"]
    errors = [l for l in out if "error" in l.lower() or "Check failure" in l or "coordination" in l.lower()]
    steps = sorted(int(n) for n in r["checkpoints"] if n.isdigit())
    assert r["code"] == 1, out[-20:]
    assert r["seconds"] < HEARTBEAT + 5, r["seconds"]
    who = "process 1 of 2 (" if lost == 1 else "process 0 of 2 (the coordinator; "
    assert len(errors) == 1 and errors[0].startswith(f"revtrain: error: lost {who}"), out[-20:]
    assert out[-1] == errors[0] and f"the newest checkpoint (step {steps[-1]}) is kept; start the same command " \
        "on every host to resume" in errors[0], out[-20:]
    assert steps[-1] in (5, 10)  # (step 10's save may not have finished on both processes)
    assert all(n.isdigit() or ".orbax-checkpoint-tmp" in n for n in r["checkpoints"]), r["checkpoints"]
    return steps[-1]


@pytest.mark.slow  # two training processes and a heartbeat timeout
def test_a_lost_process_stops_the_other_with_one_line_within_the_heartbeat_timeout(tmp_path, byte_lm_data_dir):
    """Both directions at once (two two-process runs side by side): kill -9 of process 1 in one, of process
    0 (the coordinator) in the other; each survivor prints one line naming the lost process and the newest
    checkpoint and exits 1 within the heartbeat timeout (5 s here), with no C++ trace."""
    results = {}

    def scenario(lost):
        try:
            results[lost] = _lose_one(tmp_path / f"run{lost}", lost, byte_lm_data_dir, tmp_path)
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            results[lost] = e

    threads = [threading.Thread(target=scenario, args=(lost,)) for lost in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    for lost in (1, 0):
        if isinstance(results.get(lost), BaseException):
            raise results[lost]
        _survivor_reported(results[lost], lost)


@pytest.mark.slow  # make test-all: four two-process runs one after another
@pytest.mark.parametrize("lost", [1, 0])
def test_after_a_lost_process_the_same_command_resumes_exactly(tmp_path, lost, byte_lm_data_dir):
    """After the loss above, the same command on both processes resumes from the newest checkpoint, and its
    steps after the checkpoint equal the first run's bit for bit."""
    workdir = tmp_path / "run"
    first = _lose_one(workdir, lost, byte_lm_data_dir, tmp_path)
    newest = _survivor_reported(first, lost)
    before = first["records"]
    procs = _pair(workdir, 15, byte_lm_data_dir, tmp_path, "resume")
    try:
        codes = [p.wait(timeout=400) for p, _ in procs]
    finally:
        _kill_all(procs)
    assert codes == [0, 0], _read(procs[0][1])[-3000:] + _read(procs[1][1])[-3000:]
    assert f"resumed from checkpoint at step {newest}" in _read(procs[0][1])
    after = records_by_step(workdir)
    assert sorted(after) == list(range(1, 16))
    redone = [s for s in before if s > newest]
    assert redone, (newest, sorted(before))
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


# -- signals: bursts, and eval / sample / check ----------------------------------------------------------

def test_signals_within_the_burst_window_count_as_one(monkeypatch):
    """The policy itself (no process is stopped): a signal within BURST_WINDOW of the last one that counted
    is the same request; one after it asks again."""
    from revtrain.lifecycle import interrupts
    stops = []
    guard = interrupts.Interrupts(log=lambda line: stops.append(("log", line)))
    monkeypatch.setattr(guard, "stop_now", lambda signum, message, code: stops.append((code, message)))
    guard.idle = False
    window = interrupts.BURST_WINDOW
    assert window == 1.0 and guard.burst_window == window
    guard._on_signal(signal.SIGTERM, now=100.0)
    guard._on_signal(signal.SIGTERM, now=100.0 + 1e-6)  # timeout: to the child and to its group at once
    guard._on_signal(signal.SIGINT, now=100.0 + 0.9 * window)
    assert guard.signal == signal.SIGTERM
    assert stops == [("log", "received SIGTERM: saving and stopping after the current step; send it again to "
                              "stop at once")]
    guard._on_signal(signal.SIGTERM, now=100.0 + 0.9 * window + 1.01 * window)  # a later, second request
    assert stops[-1] == (128 + signal.SIGTERM, "received SIGTERM again: stopped at once, the steps after the "
                                               "newest checkpoint are lost")
    monkeypatch.setenv("REVTRAIN_SIGNAL_BURST_SECONDS", "0")
    assert interrupts.Interrupts().burst_window == 0.0


@pytest.fixture(scope="module")
def burst_run(tmp_path_factory, byte_lm_data_dir):
    """A run (checkpoint every step) stopped by a burst: SIGTERM to the process and to its process group at
    once, as timeout, scancel and mpirun send it, after step 3. Returns (exit status, stderr lines, workdir);
    its checkpoints 1..N serve the eval / sample / check tests below."""
    workdir = tmp_path_factory.mktemp("signals") / "run"
    proc = subprocess.Popen([sys.executable, "-m", "revtrain", "train", *TINY, "--gin", "STEPS = 1000", "--gin",
                             "train.checkpoint_every = 1", "--gin", "train.keep_checkpoints = 100",
                             "--workdir", str(workdir)], stderr=subprocess.PIPE, text=True,
                            env=env(data_dir=byte_lm_data_dir, isolated=True, **_CACHE), start_new_session=True)
    try:
        out = []
        for line in proc.stderr:
            out.append(line.rstrip())
            if line.startswith("step 3/"):
                os.kill(proc.pid, signal.SIGTERM)
                os.killpg(proc.pid, signal.SIGTERM)
                break
        out += proc.stderr.read().splitlines()
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, out, workdir


@pytest.mark.slow  # make test: one signal's save and stop in this file
def test_a_burst_from_timeout_saves_and_stops_like_one_signal(burst_run):
    """The burst is one request: the step is saved and the run exits 0 (not the stop-at-once path)."""
    code, out, workdir = burst_run
    assert code == 0, out[-10:]
    received = [l for l in out if "received SIGTERM" in l]
    assert received[0] == "received SIGTERM: saving and stopping after the current step; send it again to stop " \
        "at once" and len(received) == 2 and received[1].startswith("received SIGTERM: saving step "), out[-10:]
    saved = int(received[1].split("saving step ")[1].split()[0])
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == list(range(1, saved + 1))
    assert not [l for l in out if "again:" in l or "Traceback" in l], out


@pytest.fixture
def four_checkpoints(burst_run, tmp_path):
    """A copy of the burst run's workdir (checkpoints 1..N, N >= 3, nothing scored yet); returns (workdir, N)."""
    workdir = tmp_path / "run"
    shutil.copytree(burst_run[2], workdir)
    steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir())
    assert steps[0] == 1 and steps[-1] >= 3, steps
    return workdir, steps[-1]


def _signalled(target: str, gaps: str, args: list, data_dir: str):
    """``revtrain ARGS`` signalling itself when ``target`` is first called (tests/_signal_inside.py)."""
    result = subprocess.run([sys.executable, str(REPO / "tests" / "_signal_inside.py"), target, gaps, "--",
                             *[str(a) for a in args]], capture_output=True, text=True, timeout=300,
                            env=env(data_dir=data_dir, isolated=True, **_CACHE))
    return result.returncode, result.stdout, [l for l in result.stderr.splitlines() if l.strip()]


def _eval_steps(workdir) -> list:
    path = workdir / "metrics" / "eval.jsonl"
    return [json.loads(l)["step"] for l in path.read_text().splitlines()] if path.exists() else []


def _steps(first: int, last: int) -> str:
    return ", ".join(str(s) for s in range(first, last + 1))


@pytest.mark.slow  # make test: a signal before the final evaluation; test_reliability's signals
@pytest.mark.parametrize("gaps", ["", "0"])  # (two signals at once: "0")
def test_a_signal_during_eval_all_finishes_the_step_being_scored_and_says_what_is_left(
        four_checkpoints, byte_lm_data_dir, gaps):
    """One SIGTERM (or two at once) while step 1 is scored: step 1 is finished and written, the others are
    not scored, exit 0, and eval.jsonl holds whole records only."""
    workdir, last = four_checkpoints
    code, out, err = _signalled("revtrain.loop._evaluate_or_oom", gaps, ["eval", "--workdir", workdir, "--all"],
                                byte_lm_data_dir)
    assert code == 0, err
    assert err[0] == "received SIGTERM: finishing the scoring of step 1, then stopping; send it again to stop at " \
        "once", err
    assert out.startswith("eval at step 1 (validation): loss ") and len(out.splitlines()) == 1, out  # (stdout)
    assert err[1:] == ["received SIGTERM: stopped after scoring step 1; scored: 1 (in metrics/eval.jsonl); not "
                       f"scored: {_steps(2, last)} (the same command scores them)"], err
    assert _eval_steps(workdir) == [1]


def test_a_second_signal_during_eval_stops_at_once_and_keeps_eval_jsonl_intact(four_checkpoints, byte_lm_data_dir):
    workdir, last = four_checkpoints
    code, out, err = _signalled("revtrain.loop._evaluate_or_oom", "1.5", ["eval", "--workdir", workdir, "--all"],
                                byte_lm_data_dir)
    assert code == 128 + signal.SIGTERM, err
    assert err == ["received SIGTERM: finishing the scoring of step 1, then stopping; send it again to stop at once",
                   "revtrain: received SIGTERM again: stopped at once, the scoring of step 1 is lost; scored: none "
                   f"(in metrics/eval.jsonl); not scored: {_steps(1, last)} (the same command scores them)"], err
    assert _eval_steps(workdir) == []


def test_a_signal_during_sampling_stops_at_once_saying_nothing_was_written(tmp_path, four_checkpoints,
                                                                           byte_lm_data_dir):
    workdir, last = four_checkpoints
    output = tmp_path / "samples" / "sample.bin"
    output.parent.mkdir()
    code, out, err = _signalled("revtrain.sample.generate", "", ["sample", "--workdir", workdir, "--length", "2000",
                                                                  "--output", output], byte_lm_data_dir)
    assert code == 128 + signal.SIGTERM, err
    assert err == [f"revtrain: received SIGTERM: stopped at once, the 1 x 2000-byte sample from step {last} did not "
                   "finish; nothing was written"], err
    assert out == "" and not list(output.parent.iterdir())


def test_a_signal_during_check_stops_at_once_saying_how_far_it_got(four_checkpoints, byte_lm_data_dir):
    workdir, _ = four_checkpoints
    code, out, err = _signalled("revtrain.check._Checker.backprop", "", ["check", "--workdir", workdir],
                                byte_lm_data_dir)
    assert code == 128 + signal.SIGTERM, err
    assert err[-1] == "revtrain: received SIGTERM: stopped at once, check got as far as float32 forward: 3 of 3 " \
        "layers; no verdict", err
    assert all(l.startswith("check float32 forward: ") for l in err[:-1]), err
    assert out == ""  # no table, no verdict


# -- check at depth ---------------------------------------------------------------------------------------

def _check_deep(depth: int, d_model: int, data_dir: str, timeout: float):
    cmd = [sys.executable, "-m", "revtrain", "check", "--config", CONFIG, "--gin",
           f"ReversibleTransformerLM.num_layers = {depth}", "--gin", f"ReversibleTransformerLM.d_model = {d_model}",
           "--gin", "ReversibleTransformerLM.num_heads = 2", "--gin", "ByteLMTask.sequence_length = 32",
           "--gin", "train.batch_size = 4", "--gin", "train.sample_every = 0"]
    start = time.monotonic()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                            env=env(data_dir=data_dir, isolated=True, **_CACHE))
    return result, time.monotonic() - start


def _check_deep_passes(result, depth: int) -> None:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    out, err = result.stdout.splitlines(), result.stderr.splitlines()
    n = depth + 2
    assert out[0].endswith(f"{n} layers, one batch of 4 on 1 device(s); reference: backprop one layer at a time; "
                           "ReversibleTrainer.rebuild = 'exact'; update: fused per layer")
    rows = [l.split() for l in out if l.startswith(("embedding", "block_", "head"))]
    assert len(rows) == n
    for row in rows:  # layer-at-a-time backprop: the reversible trainer equals it bit for bit, both dtypes
        # and (the last two columns) the other rebuild mode
        assert [v for v in row[2:] if v != "-"] == ["0.0e+00"] * (6 if row[1] == "reversible" else 3), row
    # (the gradients' verdict, then the optimizer step's: revtrain/check_optimizer.py)
    assert out[-2].startswith("PASS: compute dtype float32") and "every layer bit-identical" in out[-2], out[-2:]
    assert out[-1].startswith("PASS: optimizer step") and "bit for bit" in out[-1], out[-1]
    for dtype in ("float32", "bfloat16"):  # progress on stderr, every few layers of each pass
        for what in ("forward", "reversible backward (exact rebuild)", "backprop"):
            seen = [l for l in err if l.startswith(f"check {dtype} {what}: ")]
            assert len(seen) >= 4 and seen[-1] == f"check {dtype} {what}: {n} of {n} layers", err


def test_a_signal_before_the_final_evaluation_is_not_lost(tmp_path, byte_lm_data_dir, capfd):
    """SIGTERM after the last checkpoint, as the final evaluation starts: the run stops at once (exit 0)
    saying the evaluation is skipped and how to get it; the same command then runs only that evaluation
    (no step trained again), and a third time has nothing to do."""
    from revtrain import cli
    workdir = tmp_path / "run"
    args = ["train", *TINY, "--gin", "STEPS = 2", "--gin", "train.checkpoint_every = 0", "--workdir", workdir]
    code, out, err = _signalled("revtrain.loop._eval_and_write", "", args, byte_lm_data_dir)
    assert code == 0, err
    assert err[-1] == ("revtrain: received SIGTERM after the final checkpoint was saved: the final evaluation is "
                       "skipped (rerun the same command to run it); the newest checkpoint (step 2) is kept"), err
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2"] and _eval_steps(workdir) == []
    trained = (workdir / "metrics" / "train.jsonl").read_text()
    capfd.readouterr()
    assert cli.main([str(a) for a in args]) == 0
    lines = [l for l in capfd.readouterr().err.splitlines() if l.strip()]
    assert lines[0] == "already at step 2 = train.steps; its final evaluation is missing: running it", lines
    assert lines[1].startswith("eval at step 2 (validation): loss ") and len(lines) == 2, lines
    assert _eval_steps(workdir) == [2] and (workdir / "metrics" / "train.jsonl").read_text() == trained
    assert cli.main([str(a) for a in args]) == 0
    assert [l for l in capfd.readouterr().err.splitlines() if l.strip()] == [
        "already at step 2 = train.steps; nothing to do (a larger train.steps continues the run)"]
    assert _eval_steps(workdir) == [2]


@pytest.mark.slow  # make test-all (make test: a signal before the final evaluation keeps its step)
@pytest.mark.parametrize("what, target", [("sample", "revtrain.generate.training_sample"),
                                          ("evaluation", "revtrain.loop._eval_and_write")])
def test_a_failed_periodic_sample_or_evaluation_keeps_its_step(what, target, tmp_path, byte_lm_data_dir, capfd,
                                                               monkeypatch):
    """A periodic sample (or evaluation) that raises at step 2, with no periodic checkpoints: step 2 is
    saved before the error, which is one line naming what failed and the checkpoint kept (exit 1); the same
    command resumes from step 2."""
    import importlib

    from revtrain import cli
    module, name = target.rsplit(".", 1)

    def broken(*args, **kwargs):
        raise ValueError("Too few leaves for PyTreeDef; expected 3, got 2")

    monkeypatch.setattr(importlib.import_module(module), name, broken)
    workdir = tmp_path / "run"
    every = "train.sample_every = 2" if what == "sample" else "train.eval_every = 2"
    args = ["train", *TINY, "--gin", "STEPS = 4", "--gin", "train.checkpoint_every = 0", "--gin", every,
            "--workdir", str(workdir)]
    assert cli.main(args) == 1
    lines = [l for l in capfd.readouterr().err.splitlines() if l.strip()]
    assert lines[-1] == (f"revtrain: error: the {what} at step 2 failed (ValueError: Too few leaves for PyTreeDef; "
                         "expected 3, got 2); training stopped, the newest checkpoint (step 2) is kept; rerun with "
                         "--verbose for the traceback"), lines
    assert not [l for l in lines if "Traceback" in l]
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2"]
    monkeypatch.undo()
    assert cli.main(args) == 0
    lines = [l for l in capfd.readouterr().err.splitlines() if l.strip()]
    assert lines[0].startswith("resumed from checkpoint at step 2 "), lines


@pytest.mark.slow  # check of a deep model (test_check covers check in make test)
def test_check_of_a_deep_model_uses_layer_at_a_time_backprop_and_reports_progress(byte_lm_data_dir):
    """Above 16 layers check's reference is backprop one layer at a time: each pass's programs compile once
    per distinct layer (the whole-model backprop program of a deep model takes XLA minutes to compile)."""
    result, _ = _check_deep(17, 16, byte_lm_data_dir, timeout=300)
    _check_deep_passes(result, 17)


@pytest.mark.slow  # make test-all: the depth-48 models (times in docs/faults.md)
@pytest.mark.parametrize("d_model", [32, 16])
def test_check_at_depth_48(byte_lm_data_dir, d_model):
    result, seconds = _check_deep(48, d_model, byte_lm_data_dir, timeout=600)
    _check_deep_passes(result, 48)
    print(f"check at depth 48, d_model {d_model}: {seconds:.1f} s")


def test_a_heartbeat_timeout_below_one_second_is_a_usage_error(monkeypatch):
    from revtrain import cli
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(k, raising=False)
    args = cli.parse_args(["train", "--workdir", "w", "--coordinator_address", "127.0.0.1:1", "--num_processes",
                           "2", "--process_id", "0", "--heartbeat_timeout", "0"])
    with pytest.raises(cli.UsageError, match="--heartbeat_timeout must be a positive number of seconds, got 0"):
        cli._init_distributed(args)
