"""A run is never lost or corrupted (issue 13): the workdir lock, finished and damaged runs, gin includes and
values, changed data, duplicate metrics, signals, out of memory, resume differences and XLA's log noise.

Each case checks the exit status, the line(s) on stderr and the files left in the workdir. Most run
`revtrain` in this process on a tiny model (one block, d_model 16, batch 2) and its own small corpus;
subprocesses only where a real process is the point (signals, a lock's holder, two hosts). The cases that
need a finished run come last: that run trains in its own process from the start of the module, while the
others run.
"""

import json
import os
import pathlib
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from revtrain import cli
from revtrain.lifecycle import workdir as workdir_lib
from revtrain.data import byte_lm

from helpers import CONFIG, REPO, env, free_port

TINY = ["--config", CONFIG, "--gin", "ReversibleTransformerLM.num_layers = 1",
        "--gin", "ReversibleTransformerLM.d_model = 16", "--gin", "ReversibleTransformerLM.num_heads = 1",
        "--gin", "train.batch_size = 2", "--gin", "evaluate.max_batches = 1", "--gin", "train.log_every = 1",
        "--gin", "STEPS = 4", "--gin", "WARMUP = 1", "--gin", "train.checkpoint_every = 2"]


_CACHE = {}  # JAX's compilation-cache settings of this module, passed on to its subprocesses


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    """The same tiny programs compile once for the whole module, here and in its subprocesses: JAX's
    persistent compilation cache in a fresh directory (each run would otherwise compile its ~90 programs
    again; the cache changes no result)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc
    settings = {"jax_compilation_cache_dir": str(tmp_path_factory.mktemp("xla_cache")),
                "jax_persistent_cache_min_compile_time_secs": 0, "jax_persistent_cache_min_entry_size_bytes": 0}
    saved = {name: getattr(jax.config, name) for name in settings}
    for name, value in settings.items():
        jax.config.update(name, value)
    cc.reset_cache()
    _CACHE.update({name.upper(): str(value) for name, value in settings.items()})
    yield
    _CACHE.clear()
    for name, value in saved.items():
        jax.config.update(name, value)
    cc.reset_cache()


def run(capfd, *argv):
    """``revtrain ARGV`` in this process: (exit status, non-empty stderr lines)."""
    code = cli.main([str(a) for a in argv])
    return code, [line for line in capfd.readouterr().err.splitlines() if line.strip()]


def snapshot(workdir: pathlib.Path) -> dict:
    """Every file under ``workdir`` but the lock file, with its size and modification time."""
    return {str(p.relative_to(workdir)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(workdir.rglob("*")) if p.is_file() and p.name != workdir_lib.LOCK_FILE}


def records(workdir: pathlib.Path, kind: str) -> list[int]:
    path = workdir / "metrics" / f"{kind}.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def checkpoint_steps(workdir: pathlib.Path) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def _text(seed: int, size: int = 64_000) -> bytes:
    words = [b"the", b"reversible", b"layer", b"of", b"a", b"network", b"keeps", b"no", b"activations", b"and"]
    rng = np.random.RandomState(seed)
    return b" ".join(words[i] for i in rng.randint(0, len(words), size // 5))[:size]


def _copy(base, tmp_path) -> pathlib.Path:
    workdir = tmp_path / "run"
    shutil.copytree(base[0], workdir)
    return workdir


@pytest.mark.parametrize("argv, binding, value", [
    (["--gin.train.steps=abc"], "train.steps = abc", "abc"),
    (["--gin", "train.batch_size = [2, x]"], "train.batch_size = [2, x]", "x"),
])
def test_a_value_that_is_not_a_literal_names_its_binding(tmp_path, capfd, argv, binding, value):
    code, lines = run(capfd, "train", *TINY, *argv, "--workdir", tmp_path / "w")
    name = binding.split(" = ")[0]
    assert (code, lines) == (2, [f"revtrain: error: bad value in the gin binding '{binding}': {value} is not a "
                                 "number, string, list or other Python literal; quote a string "
                                 f"(\"{name} = '{value}'\"), write @name for a configurable and %NAME for a macro"])
    assert not (tmp_path / "w").exists()


def test_includes_resolve_next_to_the_including_file(tmp_path, monkeypatch, capfd):
    import gin
    (tmp_path / "base.gin").write_text("include 'enwik_small.gin'\nReversibleTransformerLM.d_model = 48\n")
    (tmp_path / "child.gin").write_text("include 'base.gin'\ntrain.steps = 3\n")
    (tmp_path / "bad.gin").write_text("include 'nothere.gin'\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cli._parse_gin([str(tmp_path / "child.gin")], [])  # base.gin beside it, enwik_small.gin from configs/
    try:
        assert gin.query_parameter("train.steps") == 3
        assert gin.query_parameter("ReversibleTransformerLM.d_model") == 48
        assert gin.query_parameter("ReversibleTransformerLM.num_layers") == 6
    finally:
        gin.clear_config()
    code, lines = run(capfd, "train", "--config", tmp_path / "bad.gin", "--workdir", "w")
    assert (code, lines) == (2, [f"revtrain: error: config file not found: nothere.gin (included by "
                                 f"{tmp_path / 'bad.gin'}; searched {tmp_path}, {elsewhere}, {REPO / 'configs'}, "
                                 f"{REPO / 'examples'})"])
    assert not (elsewhere / "w").exists()


def test_resume_differences_resolve_macros_and_references():
    from revtrain import ginconfig
    saved = """
STEPS = 700
optax.warmup_cosine_decay_schedule.decay_steps = %STEPS
optax.warmup_cosine_decay_schedule.peak_value = 0.003
ReversibleTransformerLM.dropout_rate = 0.0
ReversibleTransformerLM.grid_bits = 18
train.learning_rate = @optax.warmup_cosine_decay_schedule()
train.optimizer = @optax.adamw
train.steps = %STEPS
scope/train.seed = 0
"""
    now = saved.replace("STEPS = 700", "STEPS = 900").replace("0.003", "0.001").replace(
        "dropout_rate = 0.0", "dropout_rate = 0.1").replace("grid_bits = 18", "grid_bits = None").replace(
        "@optax.adamw", "@optax.lion") + "optax.lion.b1 = 0.95\n"
    assert ginconfig.config_differences(saved, saved) == []
    assert ginconfig.config_differences(saved, now) == [
        "optax.lion.b1 (unset) -> 0.95",
        "optax.warmup_cosine_decay_schedule.decay_steps 700 -> 900",
        "optax.warmup_cosine_decay_schedule.peak_value 0.003 -> 0.001",
        "ReversibleTransformerLM.dropout_rate 0.0 -> 0.1",
        "ReversibleTransformerLM.grid_bits 18 -> None",
        "train.optimizer @optax.adamw -> @optax.lion",
        "train.steps 700 -> 900",
    ]


def test_a_changed_source_is_prepared_again_once_and_only_then(tmp_path, monkeypatch, capfd, byte_lm_data_dir):
    corpus, data_dir = tmp_path / "corpus.txt", str(tmp_path / "data")
    corpus.write_bytes(_text(2, 8000))
    first = byte_lm.load_byte_lm(str(corpus), 16, data_dir)
    record = json.loads((pathlib.Path(first.data_dir) / byte_lm.FINGERPRINT_FILE).read_text())
    assert record["stat"]["size"] == 8000 and len(record["sha256"]) == 64
    capfd.readouterr()

    def fail(*args, **kwargs):
        raise AssertionError("prepared again")

    with monkeypatch.context() as m:  # unchanged, or touched with the same bytes: neither re-read nor prepared
        m.setattr(byte_lm.ByteLM, "_split_generators", fail)
        byte_lm.load_byte_lm(str(corpus), 16, data_dir)
        os.utime(corpus)
        byte_lm.load_byte_lm(str(corpus), 16, data_dir)
        m.setattr(byte_lm, "read_source", fail)
        byte_lm.load_byte_lm(str(corpus), 16, data_dir)  # the touch was recorded: no hash this time
        # The default source is a pinned file: never hashed, never prepared again.
        byte_lm.load_byte_lm(byte_lm.GENSIM_SOURCE, 128, byte_lm_data_dir)
    assert "data source" not in capfd.readouterr().err

    # Other bytes with the same size and modification time (cp -p, rsync -t): still caught.
    stat = corpus.stat()
    changed = _text(3, 8000)
    corpus.write_bytes(changed)
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    again = byte_lm.load_byte_lm(str(corpus), 16, data_dir)
    err = [line for line in capfd.readouterr().err.splitlines() if line.startswith("data source")]
    assert err == [f"data source {corpus} changed since it was prepared (content differs); preparing it again"]
    assert bytes(np.asarray(again.as_data_source("train")[0]["bytes"])) == changed[:17]

    # A dataset prepared before fingerprints were recorded: its bytes are unknown, so it is prepared again.
    (pathlib.Path(again.data_dir) / byte_lm.FINGERPRINT_FILE).unlink()
    byte_lm.load_byte_lm(str(corpus), 16, data_dir)
    err = [line for line in capfd.readouterr().err.splitlines() if line.startswith("data source")]
    assert err == [f"data source {corpus} has no recorded fingerprint (prepared by an older revtrain); "
                   "preparing it again"]
    assert (pathlib.Path(again.data_dir) / byte_lm.FINGERPRINT_FILE).exists()


def test_xla_slow_operation_lines_stay_off_stderr(capfd):
    """XLA's slow-operation alarm (the "Very slow compile?" line, and its "Constant folding ... is taking
    > 1s" twin, both E-level C++ logs of slow_operation_alarm.cc) must not reach stderr without --verbose.
    Constant-folding a 3000 x 3000 matmul of constants takes well over a second, which fires the alarm."""
    import jax
    import jax.numpy as jnp
    cli._quiet_libraries(verbose=False)
    c = np.random.RandomState(0).rand(3000, 3000).astype(np.float32)  # (this module's cache starts empty)
    start = time.time()
    jax.jit(lambda: (jnp.asarray(c) @ jnp.asarray(c)).sum())().block_until_ready()
    assert time.time() - start > 1.2  # long enough for the alarm (1 s) to have fired
    err = capfd.readouterr().err
    assert "slow_operation_alarm" not in err and "Constant folding" not in err, err


@pytest.mark.slow  # compiles a model too large for the limit
def test_out_of_memory_is_one_line_with_the_bytes_and_leaves_no_workdir(tmp_path, capfd, byte_lm_data_dir):
    """The issue's case, ByteLMTask.sequence_length = 100000 (attention scores of 2 x 100000^2 floats per
    head), with this process's address space capped 16 GiB above its current size while it runs, so that
    the allocation fails whatever the machine's memory and overcommit policy."""
    workdir = tmp_path / "run"
    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (size + (16 << 30), hard))
    try:
        # The memory plan refuses this run before it allocates (tests/test_memory_plan.py); without the plan
        # the step's own out-of-memory error is the one line.
        code, lines = run(capfd, "train", *TINY, "--gin", "ByteLMTask.sequence_length = 100000",
                          "--gin", "train.log_every = 100", "--gin", "train.memory_plan = False", "--workdir", workdir)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    errors = [l for l in lines if l.startswith("revtrain:")]
    assert code == 1 and len(errors) == 1, lines
    assert errors[0].startswith("revtrain: error: training step 1 ran out of memory: it needed "), errors
    assert (" bytes) in one allocation; lower it with train.batch_size, ByteLMTask.sequence_length, "
            "ReversibleTrainer.offload = True or attention blocking (ReversibleTransformerLM.attention_block) "
            "(--verbose shows XLA's message); no checkpoint was written (the workdir it created is removed)"
            ) in errors[0]
    assert not workdir.exists()


def _start(workdir, *args):
    return subprocess.Popen([sys.executable, "-m", "revtrain", "train", *args, "--workdir", str(workdir)],
                            stderr=subprocess.PIPE, text=True, env=env(**_CACHE))


class _Scenario(threading.Thread):
    """Finishes a scenario whose processes are already started (waiting, signalling) in a thread;
    `result` returns what it returned (or raises what it raised)."""

    def __init__(self, fn, *args):
        super().__init__(daemon=True)
        self.fn, self.args, self.value, self.error = fn, args, None, None
        self.start()

    def run(self):
        try:
            self.value = self.fn(*self.args)
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            self.error = e

    def result(self, timeout: float = 600):
        self.join(timeout)
        assert not self.is_alive(), "the scenario did not finish"
        if self.error is not None:
            raise self.error
        return self.value


def _signal_during_compile(proc, workdir):
    """SIGTERM 2 s into the first step of an 18-layer backprop model, whose one fused program takes XLA
    minutes to compile (150 s measured on 2 shared cores; main's code exited 164 s after the signal)."""
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line.rstrip())
            if "steps 0->4" in line:
                break
        time.sleep(2)
        sent = time.time()
        proc.send_signal(signal.SIGTERM)
        rest = [l for l in proc.stderr.read().splitlines() if not l.startswith("memory plan (")]  # (after the first line)
        proc.wait(timeout=60)
        return {"code": proc.returncode, "seconds": time.time() - sent, "before": lines, "after": rest,
                "workdir_left": workdir.exists()}
    finally:
        proc.kill()


_TWO_HOSTS = """
import sys
from revtrain import cli
from revtrain.lifecycle import workdir
args = cli.parse_args(["eval", "--workdir", sys.argv[1], "--coordinator_address", sys.argv[2], "--num_processes",
                       "2", "--process_id", sys.argv[3]])
cli._init_distributed(args)
try:
    workdir.acquire(sys.argv[1], "eval")
except workdir.WorkdirBusy as e:
    print(e, file=sys.stderr)
    sys.exit(2)
"""


def _two_hosts(procs, holder):
    try:
        errs = [p.communicate(timeout=300)[1] for p in procs]
        return [p.returncode for p in procs], errs
    finally:
        holder.release()
        for p in procs:
            p.kill()


def _selected(request, name: str) -> bool:
    """Whether this session runs this module's test ``name`` (after ``-m``, ``-k`` and node ids)."""
    return any(item.module is request.module and item.originalname == name for item in request.session.items)


@pytest.fixture(scope="module", autouse=True)
def background(request, tmp_path_factory, compilation_cache, byte_lm_data_dir):
    """Scenarios that are separate processes anyway start with the module, so that they run on the second
    core while this process compiles its own runs: a signal during a long first compile, and a two-process
    run refused by the lock; each only where the session runs its test (make test leaves out the slow
    compile's: its process costs about 15 s of CPU). Their tests check the results."""
    root = tmp_path_factory.mktemp("background")
    scenarios = {}
    if _selected(request, "test_a_signal_during_the_first_compile_stops_at_once"):
        compile_workdir = root / "compile"
        compiling = _start(compile_workdir, *TINY, "--gin", "train.trainer = @StandardTrainer",
                           "--gin", "ReversibleTransformerLM.num_layers = 16")
        scenarios["compile"] = (_Scenario(_signal_during_compile, compiling, compile_workdir), compile_workdir)
    if _selected(request, "test_two_hosts_are_refused_together_when_process_0_cannot_lock"):
        hosts_workdir = root / "hosts"
        hosts_workdir.mkdir()
        holder = workdir_lib.WorkdirLock(str(hosts_workdir), "test")
        port = free_port()
        hosts = [subprocess.Popen([sys.executable, "-c", _TWO_HOSTS, str(hosts_workdir), f"127.0.0.1:{port}",
                                   str(i)], stderr=subprocess.PIPE, text=True, env=env(isolated=True, **_CACHE))
                 for i in range(2)]
        scenarios["hosts"] = (_Scenario(_two_hosts, hosts, holder), hosts_workdir)
    yield scenarios
    for scenario, _ in scenarios.values():
        scenario.join(timeout=120)


@pytest.mark.slow  # a cold compile of its own; make test: the signal tests of test_faults
def test_a_signal_during_the_first_compile_stops_at_once(background):
    """SIGTERM while XLA compiles the first step (the main thread inside C++ for a long time): out within
    seconds, one line, and the new workdir gone."""
    scenario, workdir = background["compile"]
    r = scenario.result()
    assert r["seconds"] < 5, r
    assert r["code"] == 0, r
    assert r["after"] == [f"revtrain: received SIGTERM before the first step finished: nothing new to save; no "
                          f"checkpoint was written (the workdir it created, {workdir}, is removed)"], r
    assert not r["workdir_left"]


def test_two_hosts_are_refused_together_when_process_0_cannot_lock(background):
    """Process 0 takes the lock for the run: when it is refused, process 1 stops with it (exit 2 on both)."""
    scenario, workdir = background["hosts"]
    codes, errs = scenario.result()
    assert codes == [2, 2], errs
    since = json.loads((workdir / workdir_lib.LOCK_FILE).read_text())["since"]
    assert errs[0].strip().splitlines() == [
        f"the workdir {workdir} is in use by revtrain test, PID {os.getpid()} on host {socket.gethostname()}, "
        f"since {since}; wait for it to finish or use another --workdir"]
    assert errs[1].strip().splitlines() == [
        f"process 0 could not lock the workdir {workdir}: it is in use by another run; wait for it to finish or "
        "use another --workdir"]


@pytest.fixture(scope="module")
def base(tmp_path_factory, compilation_cache):
    """A finished 4-step run (checkpoints 2 and 4) on its own corpus, made in a workdir that already held
    a lock left by a killed process and the metrics of an older run but no checkpoint.

    Returns ``(workdir, args, corpus)``; tests work on copies of the workdir.
    """
    root = tmp_path_factory.mktemp("reliability")
    corpus = root / "corpus.txt"
    corpus.write_bytes(_text(0))
    args = [*TINY, "--gin", f"ByteLMTask.source = '{corpus}'", "--gin", f"ByteLMTask.data_dir = '{root / 'data'}'"]
    workdir = root / "run"
    (workdir / "metrics").mkdir(parents=True)
    (workdir / "metrics" / "train.jsonl").write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n"
                                                             for s in range(1, 10)))
    (workdir / "metrics" / "eval.jsonl").write_text(json.dumps({"step": 9, "loss": 9.0}) + "\n")
    # A holder that dies holding the lock (kill -9, no clean-up of any kind).
    dead = subprocess.run([sys.executable, "-c", (
        "import fcntl, os, signal, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'{\"pid\": 1, \"host\": \"gone\"}'); "
        "os.kill(os.getpid(), signal.SIGKILL)"), str(workdir / workdir_lib.LOCK_FILE)])
    assert dead.returncode == -signal.SIGKILL
    assert cli.main(["train", *args, "--workdir", str(workdir)]) == 0
    return workdir, args, corpus


def test_a_stale_lock_does_not_block_and_old_metrics_start_over(base):
    workdir, _, _ = base
    assert records(workdir, "train") == [1, 2, 3, 4]  # the old run's 1..9 are gone, each step once
    assert records(workdir, "eval") == [4]
    assert checkpoint_steps(workdir) == [2, 4]
    assert sorted(p.name for p in workdir.iterdir()) == [".lock", "checkpoints", "config.gin", "metrics",
                                                         "tensorboard"]


def test_a_busy_workdir_is_refused_at_once_naming_the_holder(base, tmp_path, capfd):
    workdir = _copy(base, tmp_path)
    before = snapshot(workdir)
    holder = workdir_lib.WorkdirLock(str(workdir), "test")  # another open file: flock refuses this process too
    try:
        since = json.loads((workdir / workdir_lib.LOCK_FILE).read_text())["since"]
        who = f"revtrain test, PID {os.getpid()} on host {socket.gethostname()}, since {since}"
        for argv in (["train", *base[1]], ["eval"], ["check"]):
            code, lines = run(capfd, *argv, "--workdir", workdir)
            assert code == 2, lines
            assert lines == [f"revtrain: error: the workdir {workdir} is in use by {who}; wait for it to finish "
                             "or use another --workdir"]
    finally:
        holder.release()
    assert snapshot(workdir) == before


# Orbax reads a checkpoint's arrays in coroutines gathered at once: when several reads of the damaged step fail,
# the first failure is the one revtrain reports, and the others raise again while being closed, which Python
# reports as unraisable (in the test process only; the CLI's output is the one line asserted below).
@pytest.mark.filterwarnings("ignore:Exception ignored in. <coroutine object _read_array_index_and_device_put"
                            ":pytest.PytestUnraisableExceptionWarning")
def test_a_damaged_newest_checkpoint_is_skipped_by_eval_and_train(base, tmp_path, capfd):
    workdir = _copy(base, tmp_path)
    # Truncate every array data file to its first bytes: the readers restore only what they need (eval the
    # weights), and the order arrays take inside a file varies between runs, so half a file can keep them all.
    for f in (workdir / "checkpoints" / "4" / "state").glob("ocdbt.process_0/d/*"):
        f.write_bytes(f.read_bytes()[:8])

    code = cli.main(["eval", "--workdir", str(workdir)])
    out, err = capfd.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 0, lines
    assert lines[0].startswith("skipping the damaged checkpoint at step 4: OUT_OF_RANGE: Error reading"), lines
    assert len(lines) == 1 and out.startswith("eval at step 2 (validation): ") and out.count("\n") == 1, (lines, out)
    assert "bound method" not in err + out
    assert records(workdir, "eval") == [4, 2]

    code, lines = run(capfd, "eval", "--workdir", workdir, "--step", "4")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("revtrain: error: the checkpoint at step 4 cannot be restored: OUT_OF_RANGE")
    assert lines[0].endswith("(without --step the newest checkpoint that restores is used; others: 2)")

    code, lines = run(capfd, "train", *base[1], "--workdir", workdir)
    assert code == 0, lines
    assert lines[0].startswith("skipping the damaged checkpoint at step 4 (OUT_OF_RANGE"), lines
    assert lines[0].endswith(f"moved it to {workdir / 'damaged_checkpoints' / '4'}")
    assert lines[1].startswith("resumed from checkpoint at step 2 ")
    assert checkpoint_steps(workdir) == [2, 4]
    assert (workdir / "damaged_checkpoints" / "4" / "state").is_dir()
    assert records(workdir, "train") == [1, 2, 3, 4]  # steps 3 and 4 redone, each recorded once
    assert records(workdir, "eval") == [2, 4]  # the evaluation of the damaged step 4 went with it


@pytest.mark.slow  # make test: test_faults' signal before the final evaluation
def test_a_second_signal_stops_at_once_naming_the_intact_checkpoint(base, tmp_path):
    """The first SIGINT asks for a stop after the step; a second one, sent while a checkpoint is being
    written, stops at once: exit 130, no traceback, no false write error, no temporary directory left."""
    workdir = tmp_path / "run"
    # The second signal comes within a second of the first (signals that close count as one by default:
    # see test_faults.py), so the burst window is off here.
    proc = subprocess.Popen([sys.executable, "-m", "revtrain", "train", *base[1], "--gin", "train.steps = 1000",
                             "--gin", "train.checkpoint_every = 1", "--workdir", str(workdir)],
                            stderr=subprocess.PIPE, text=True, env=env(REVTRAIN_SIGNAL_BURST_SECONDS="0", **_CACHE))
    out = []
    for line in proc.stderr:
        out.append(line.rstrip())
        if line.startswith("step 3/"):
            proc.send_signal(signal.SIGINT)
        if line.startswith("received SIGINT: saving and stopping after the current step"):
            break
    checkpoints, deadline = workdir / "checkpoints", time.time() + 60
    while time.time() < deadline and not any("tmp" in n for n in os.listdir(checkpoints)):
        time.sleep(0.0005)
    in_flight = sorted(os.listdir(checkpoints))
    proc.send_signal(signal.SIGINT)
    out += proc.stderr.read().splitlines()
    proc.wait(timeout=60)
    assert any("orbax-checkpoint-tmp" in n for n in in_flight), in_flight
    assert proc.returncode == 128 + signal.SIGINT, out
    kept = checkpoint_steps(workdir)
    assert out[-1] == (f"revtrain: received SIGINT again: stopped at once, the steps after the newest checkpoint "
                       f"are lost; the newest checkpoint (step {kept[-1]}) is kept"), out
    assert not [l for l in out if "Traceback" in l or "error" in l], out
    assert sorted(os.listdir(checkpoints)) == [str(s) for s in kept]  # no temporary directory
    assert (checkpoints / str(kept[-1]) / "commit_success.txt").exists()


def test_a_finished_run_does_nothing_and_more_steps_continue_listing_the_changes(base, tmp_path, capfd):
    workdir = _copy(base, tmp_path)
    before = snapshot(workdir)
    code, lines = run(capfd, "train", *base[1], "--workdir", workdir)
    assert (code, lines) == (0, ["already at step 4 = train.steps; nothing to do (a larger train.steps "
                                 "continues the run)"])
    assert snapshot(workdir) == before

    # More steps (the schedule stays: its compiled programs are the base run's), other evaluation and
    # retention settings, and the corpus replaced by other bytes at the same path (last in this module: the
    # corpus is shared).
    corpus = base[2]
    original = corpus.read_bytes()
    corpus.write_bytes(_text(1))
    try:
        code, lines = run(capfd, "train", *base[1], "--gin", "train.steps = 6", "--gin", "evaluate.max_batches = 2",
                          "--gin", "train.keep_checkpoints = 2", "--workdir", workdir)
    finally:
        corpus.write_bytes(original)
    assert code == 0, lines
    assert [l for l in lines if l.startswith("data source")] == [
        f"data source {corpus} changed since it was prepared (content differs); preparing it again"]
    assert any(l.startswith("resumed from checkpoint at step 4 ") for l in lines)
    assert [l for l in lines if l.startswith("changed since")] == [
        "changed since the saved config.gin (3): evaluate.max_batches 1 -> 2; train.keep_checkpoints 3 -> 2; "
        "train.steps 4 -> 6"]
    assert records(workdir, "train") == [1, 2, 3, 4, 5, 6]
    assert checkpoint_steps(workdir) == [4, 6]
