"""The memory plan (revtrain/planning/): exact parts from shapes, the limits it reads (revtrain/limits.py),
the refusal inside a memory cgroup, `revtrain plan`, and the host memory fields of train.jsonl."""

import json

import jax
import numpy as np
import optax
import pytest

from revtrain import limits, memory, pinned, planning
from revtrain.models.transformer_lm import ReversibleTransformerLM

from helpers import REPO, in_cgroup, make_memory_cgroup, revtrain, revtrain_here

LLAMA = str(REPO / "configs" / "llama_small.gin")
SHORT = ["--gin", "STEPS = 2", "--gin", "WARMUP = 1", "--gin", "train.batch_size = 2", "--gin", "train.log_every = 1",
         "--gin", "evaluate.max_batches = 1", "--gin", "train.sample_every = 0"]
B, T, D, LAYERS = 4, 16, 32, 3
NO_LIMIT = {"host": (2**50, "test")}


def memory_plan_shard(shape):
    from revtrain.placement import shard_axis
    return shard_axis(shape, 2) is not None


def _spec(batch):
    shape = jax.ShapeDtypeStruct((batch, T), np.int32)
    return {"inputs": shape, "targets": shape}


def _host(pageable=None):
    """A host tier on one device, its state pageable (the CPU's) or, ``pageable=False``, pinned (a GPU's)."""
    from revtrain.placement import make_mesh
    from revtrain.tiers.host import HostTier
    return HostTier(make_mesh(jax.devices()[:1]), pageable=pageable)


def _disk(tmp_path):
    """A disk tier on one device, its files in ``tmp_path/offload``."""
    from revtrain.placement import make_mesh
    from revtrain.tiers.disk import DiskTier
    return DiskTier(make_mesh(jax.devices()[:1]), directory=str(tmp_path / "offload"))


@pytest.fixture(scope="module")
def model():
    return ReversibleTransformerLM(T, num_layers=LAYERS, d_model=D, num_heads=2, dropout_rate=0.0)


@pytest.fixture(scope="module")
def shared():
    """One optimizer and one `planning.PlanPrograms` for the module's plans of `model`: each distinct program is
    compiled once (as `planning.choices` shares one cache between a run's choices)."""
    return optax.adamw(1e-3), planning.PlanPrograms()


def _exact(model):
    """Bytes counted from the arrays themselves (not the shapes): params, AdamW state per layer."""
    params = [layer.init_params for layer in model.layers]
    weights = sum(x.nbytes for p in params for x in jax.tree.leaves(p))
    opt = sum(np.asarray(x).nbytes for p in params for x in jax.tree.leaves(optax.adamw(1e-3).init(p)))
    return weights, opt, max(sum(x.nbytes for x in jax.tree.leaves(p)) for p in params)


def test_reversible_parts_are_the_exact_byte_counts(model, shared):
    weights, opt, largest = _exact(model)
    tx, programs = shared  # (one compile cache for the module's plans)
    assert opt == 2 * weights + 4 * len(model.layers)  # two moments and one int32 count per layer
    plan = planning.plan(model, planning.Setup("reversible", tx, B, label="r"), _spec(B), 1, limits=NO_LIMIT,
                            platform="cpu", programs=programs)
    host = plan.tiers["host"]
    assert list(plan.tiers) == ["host"]  # the CPU: one tier
    assert host["weights"] == weights == 4 * plan.num_params
    assert host["optimizer_state"] == opt
    assert host["gradients"] == largest  # one layer's at a time (the fused update)
    # Saved: the embedding's input (int32 tokens); current: two float32 streams and their cotangent; the batch.
    assert host["activations"] == B * T * 4 + 2 * (2 * B * T * D * 4) + 2 * B * T * 4
    # A state below limits.ASYNC_MAX_BYTES is saved in the background: the next step makes a second copy
    # of it (it cannot donate what the write reads), and the write stages all of it (below STAGING_BYTES).
    assert host["checkpoint"] == 2 * (weights + opt)
    assert host["evaluation"] == 0  # no evaluation batch given
    assert host["runtime"] == planning.RUNTIME_BYTES
    assert host["temporaries"] > 0
    assert plan.total("host") == sum(host.values())
    assert plan.fits
    record = plan.record()
    assert record["plan_host_bytes"] == plan.total("host")
    assert record["plan_host_weights_bytes"] == weights and record["host_limit_bytes"] == 2**50


def test_save_between_steps_and_evaluation_parts(model, shared, monkeypatch):
    """A state above limits.ASYNC_MAX_BYTES is saved between steps: the save's staging, the largest layer's
    arrays and SAVE_STATE_FRACTION of the state count where they exceed the step's transient parts; an
    evaluation's where it exceeds those and the save's."""
    weights, opt, largest = _exact(model)
    tx, programs = shared  # (one compile cache for the module's plans)
    monkeypatch.setattr(limits, "ASYNC_MAX_BYTES", 0)
    setup = planning.Setup("reversible", tx, B, label="r")
    host = planning.plan(model, setup, _spec(B), 1, limits=NO_LIMIT, platform="cpu",
                            programs=programs).tiers["host"]
    step = host["gradients"] + host["activations"] + host["temporaries"]
    save = limits.STAGING_BYTES + (3 * largest + 4) + int(planning.SAVE_STATE_FRACTION * (weights + opt))
    assert host["checkpoint"] == max(0, save - step) > 0
    evaluated = planning.plan(model, setup, _spec(B), 1, limits=NO_LIMIT, platform="cpu",
                                 eval_spec=_spec(64), programs=programs).tiers["host"]
    evaluation = planning.memory._evaluation_bytes(model, setup, planning.PlanPrograms(), _spec(64), 1, None)
    # At least one device's evaluation batch and a layer's input and output (two float32 streams each).
    assert evaluation >= 2 * 64 * T * 4 + 2 * (2 * 64 * T * D * 4)
    assert evaluated["evaluation"] == max(0, evaluation - step - host["checkpoint"])
    assert {k: v for k, v in evaluated.items() if k != "evaluation"} == {k: v for k, v in host.items()
                                                                          if k != "evaluation"}


def test_standard_and_deferred_parts(model, shared):
    weights, opt, largest = _exact(model)
    tx, programs = shared  # (one compile cache for the module's plans)
    standard = planning.plan(model, planning.Setup("standard", tx, B, label="s"), _spec(B), 1, limits=NO_LIMIT,
                                platform="cpu", programs=programs).tiers["host"]
    assert standard["gradients"] == weights  # the whole tree
    assert standard["activations"] > 2 * (2 * B * T * D * 4) * LAYERS  # every block's residuals
    deferred = planning.plan(model, planning.Setup("reversible", tx, B, deferred=True, label="d"), _spec(B), 1,
                                limits=NO_LIMIT, platform="cpu", programs=programs).tiers["host"]
    assert deferred["gradients"] == weights + largest  # the whole-model buffer beside one layer's
    # Two devices: each holds the state (replicated) and half the batch; shard_state halves the large leaves.
    two = planning.plan(model, planning.Setup("reversible", tx, B, label="r"), _spec(B), 2, limits=NO_LIMIT,
                           platform="cpu", programs=programs).tiers["host"]
    assert two["weights"] == 2 * weights
    sharded = planning.plan(model, planning.Setup("reversible", tx, B, shard_state=True, label="r"), _spec(B), 2,
                               limits=NO_LIMIT, platform="cpu", programs=programs).tiers["host"]
    expected = 2 * sum(x.nbytes // 2 if memory_plan_shard(x.shape) else x.nbytes
                       for layer in model.layers for x in jax.tree.leaves(layer.init_params))
    assert weights <= sharded["weights"] == expected < two["weights"]


def test_the_host_tier_on_an_accelerator_with_pageable_memory(model, shared, monkeypatch):
    """The host tier (``offload``) on an accelerator that has pageable host memory (``"tpu"`` stands for one
    here): three tiers. The state is pageable and XLA's pinned pool holds only the transfers in flight (a layer
    fetched, a layer written back), checked against the pool's size (64 GiB by default); four layers on the
    device (the one computing, two fetched ahead, one written back) and one layer's gradient, or with the
    deferred update (microbatches) two buffers in flight."""
    weights, opt, largest = _exact(model)
    tx, programs = shared  # (one compile cache for the module's plans)
    setup = planning.Setup("reversible", tx, B, tier=_host(), label="s")  # (its state pageable)
    limits = {"host": (2**50, "t"), "device": (2**40, "t")}
    monkeypatch.delenv(pinned.PREALLOCATE_ENV, raising=False)  # (the pool's defaults, whatever this process holds)
    monkeypatch.delenv(pinned.LIMIT_ENV, raising=False)
    tpu = planning.plan(model, setup, _spec(B), 1, limits=limits, platform="tpu", programs=programs)
    assert set(tpu.tiers) == {"device", "host", "pinned"} and tpu.limits["pinned"] == 64 * 2**30
    assert tpu.tiers["pinned"]["weights"] == 2 * largest and tpu.tiers["device"]["weights"] == 4 * largest
    assert tpu.tiers["host"]["weights"] == weights + 2 * largest
    assert tpu.tiers["device"]["gradients"] == largest
    other = {s.label: s for s in planning.alternatives(setup, model, 1, True)}
    deferred = planning.plan(model, other["s + 2 microbatches"], _spec(B), 1, limits=limits, platform="tpu",
                                programs=programs)
    assert other["s + 2 microbatches"].tier.state_memory == "host" and deferred.tiers["device"]["gradients"] == 2 * largest


def test_the_host_tier_on_a_gpu_lives_in_the_pinned_pool(model, shared, monkeypatch):
    """A GPU has no pageable host memory: the state, the kept inputs and the layer being written back live in
    XLA's pinned pool, counted in the pinned tier with what the pool costs beyond them (the whole limit where
    preallocated, the doubling regions where grown) against the pool's limit; host counts the pool too."""
    weights, opt, largest = _exact(model)
    tx, programs = shared
    setup = planning.Setup("reversible", tx, B, tier=_host(pageable=False), label="s")  # (a GPU's: pinned)
    limits = {"host": (2**50, "t"), "device": (2**40, "t")}
    monkeypatch.delenv(pinned.PREALLOCATE_ENV, raising=False)
    monkeypatch.delenv(pinned.LIMIT_ENV, raising=False)
    grown = planning.plan(model, setup, _spec(B), 1, limits=limits, platform="gpu", programs=programs)
    part = grown.tiers["pinned"]
    largest_opt = max(sum(np.asarray(x).nbytes for x in jax.tree.leaves(tx.init(layer.init_params)))
                      for layer in model.layers)
    assert part["weights"] == weights + largest and part["optimizer_state"] == opt + largest_opt
    need = sum(v for k, v in part.items() if k != "pool")
    assert part["activations"] == B * T * 4  # the kept input of the embedding (int32 tokens)
    assert need + part["pool"] == pinned.grown_pool_bytes(need) == 2 * 2**20  # one 2 MiB region holds it
    assert grown.limits["pinned"] == 64 * 2**30 and grown.sources["pinned"].endswith("grown on demand")
    assert grown.tiers["host"]["pool"] == part["pool"]
    assert grown.tiers["host"]["weights"] == weights + largest  # (the layer written back beside its old copy)
    monkeypatch.setenv(pinned.PREALLOCATE_ENV, "true")
    monkeypatch.setenv(pinned.LIMIT_ENV, "3")
    pre = planning.plan(model, setup, _spec(B), 1, limits=limits, platform="gpu", programs=programs)
    assert pre.total("pinned") == 3 * 2**30 == pre.limits["pinned"] and pre.fits
    assert "pinned 3.00 GiB of 3.00 GiB (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=3, preallocated)" in pre.line()
    assert "host:pool" in planning.table([pre])


def test_the_pageable_switch_makes_the_plan_count_the_state_as_pinned(model, shared, monkeypatch):
    """On the CPU with the pageable kind switched off (`pinned.NO_PAGEABLE_ENV`, or a host tier whose state is
    pinned: its `Tier.memory_kind`) the plan has a pinned tier holding the state (ordinary host memory there: no
    pool, the host limit)."""
    weights, opt, largest = _exact(model)
    tx, programs = shared
    plain = planning.plan(model, planning.Setup("reversible", tx, B, tier=_host(), label="s"), _spec(B), 1,
                             limits=NO_LIMIT, platform="cpu", programs=programs)
    assert list(plain.tiers) == ["host"]
    monkeypatch.setenv(pinned.NO_PAGEABLE_ENV, "1")
    for setup in (planning.Setup("reversible", tx, B, tier=_host(), label="s"),  # (made with the switch off)
                  planning.Setup("reversible", tx, B, tier=_host(pageable=False), label="s")):
        plan = planning.plan(model, setup, _spec(B), 1, limits=NO_LIMIT, platform="cpu", programs=programs)
        assert list(plan.tiers) == ["host", "pinned"] and plan.limits["pinned"] == NO_LIMIT["host"][0]
        assert plan.tiers["pinned"]["weights"] == weights + largest and plan.tiers["pinned"]["pool"] == 0
        assert plan.tiers["host"] == {**plain.tiers["host"], "pool": 0}  # the same RAM, counted once
    monkeypatch.delenv(pinned.NO_PAGEABLE_ENV)
    kept = planning.plan(model, planning.Setup("reversible", tx, B, tier=_host(), label="s"), _spec(B), 1,
                            limits=NO_LIMIT,
                            platform="cpu", programs=programs)
    assert list(kept.tiers) == ["host"]


def test_refusal_names_the_settings_that_fit(model, shared):
    tx, programs = shared  # (one compile cache for the module's plans)
    own = planning.plan(model, planning.Setup("standard", tx, B, label="StandardTrainer"), _spec(B), 1,
                           limits=NO_LIMIT, platform="cpu", programs=programs)
    reversible = planning.plan(model, planning.Setup("reversible", tx, B, label="ReversibleTrainer"), _spec(B), 1,
                                  limits=NO_LIMIT, platform="cpu", programs=programs)
    limit = (reversible.total("host") + own.total("host")) // 2
    limits = {"host": (limit, "test limit")}
    own = planning.plan(model, own.setup, _spec(B), 1, limits=limits, platform="cpu", programs=programs)
    others = [planning.plan(model, s, _spec(B), 1, limits=limits, platform="cpu", programs=programs)
              for s in planning.alternatives(own.setup, model, 1, True)]
    assert not own.fits
    line = planning.refusal(own, others)
    assert "\n" not in line
    assert "StandardTrainer host needs" in line and "test limit" in line
    assert "train.trainer = @ReversibleTrainer (" in line
    # A choice that only adds settings to one that fits already is not named.
    assert "ReversibleTrainer.offload = True" not in line


def test_cgroup_limit_less_other_processes(tmp_path):
    group = tmp_path / "memory" / "jobs" / "mine"
    group.mkdir(parents=True)
    (group / "memory.limit_in_bytes").write_text(str(3 * 2**30))
    (group / "memory.stat").write_text(f"cache 999999\nrss {2**30}\ntotal_cache 999999\ntotal_rss {2**30}\n")
    (tmp_path / "memory" / "jobs" / "memory.limit_in_bytes").write_text("9223372036854771712")  # unlimited
    proc = tmp_path / "cgroup"
    proc.write_text("5:cpu:/\n4:memory:/jobs/mine\n0::/\n")
    own = 2**28
    room, where = limits._cgroup_headroom(own, str(proc), str(tmp_path))
    assert room == 3 * 2**30 - (2**30 - own)  # the limit less what the group's other processes hold
    assert "/jobs/mine" in where and "3.00 GiB" in where
    (tmp_path / "memory" / "jobs" / "memory.limit_in_bytes").write_text(str(2**30))  # a tighter ancestor wins
    (tmp_path / "memory" / "jobs" / "memory.stat").write_text(f"total_rss {own}\n")
    assert limits._cgroup_headroom(own, str(proc), str(tmp_path))[0] == 2**30
    v2 = tmp_path / "v2"
    (v2 / "job").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("memory\n")
    (v2 / "job" / "memory.max").write_text(str(2**31))
    (v2 / "job" / "memory.stat").write_text(f"anon {own}\nfile 5\n")
    (tmp_path / "cgroup2").write_text("0::/job\n")
    assert limits._cgroup_headroom(own, str(tmp_path / "cgroup2"), str(v2))[0] == 2**31


def test_host_resident_reads_rss_and_peak():
    rss, peak = memory.host_resident()
    assert 0 < rss <= peak
    assert limits.host_limit()[0] > rss


@pytest.mark.slow  # make test: the refusal naming the settings that fit
def test_refused_inside_a_memory_cgroup_not_killed(tmp_path):
    """StandardTrainer on a 51 M-parameter Llama (measured peak 2.2 GiB) inside a 1 GiB memory cgroup: the
    plan refuses it in one line with exit status 2 before the state is placed (the kernel would kill it:
    137), naming the settings that fit and writing nothing."""
    group = make_memory_cgroup(2**30)
    workdir = tmp_path / "run"
    try:
        wrapper = in_cgroup(group)
        result = revtrain("train", "--config", LLAMA, *SHORT, "--gin", "LlamaModel.d_model = 768",
                          "--gin", "LlamaModel.num_layers = 8", "--gin", "LlamaModel.d_ff = 2048",
                          "--gin", "LlamaModel.num_heads = 12", "--gin", "LlamaModel.num_kv_heads = 4",
                          "--workdir", str(workdir), prefix=wrapper)
    finally:
        group.rmdir()
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("revtrain: error: the memory plan does not fit: StandardTrainer host needs"), line
    assert f"memory cgroup /{group.name} limit 1.00 GiB" in line
    assert "would fit" in line or "none of the trainer choices" in line
    assert not workdir.exists()


@pytest.mark.slow  # make test: the plan command in test_planning_runs, the train record in test_cli
def test_plan_command_and_host_fields_in_train_jsonl(tmp_path, capsys):
    tiny = ["--gin", "LlamaModel.d_model = 32", "--gin", "LlamaModel.num_layers = 2", "--gin", "LlamaModel.d_ff = 64"]
    result = revtrain_here(capsys, "plan", "--config", LLAMA, *SHORT, *tiny)
    assert result.returncode == 0, result.stderr
    out = result.stdout.strip().splitlines()
    assert out[0].startswith("memory plan (StandardTrainer, ") and out[0].endswith("; fits")
    header, rows = out[1].split(), [line for line in out[2:] if not line.startswith("(")]
    assert header[0] == "choice" and header[-1] == "fits" and "host:weights" in header
    labels = [r.rsplit(None, len(header) - 1)[0] for r in rows]
    assert labels[:2] == ["StandardTrainer", "ReversibleTrainer"]
    for row in rows:
        cells = row.rsplit(None, len(header) - 1)
        assert cells[-1] in ("yes", "no")
        total = float(cells[header.index("host:total")])
        assert total == pytest.approx(sum(float(c) for c in cells[1:header.index("host:total")]), abs=0.003)
    assert all(r.endswith("yes") for r in rows)  # a 10 k-parameter model fits anywhere
    result = revtrain_here(capsys, "plan", "--config", LLAMA, *SHORT, *tiny,
                           "--gin", "train.trainer = @ReversibleTrainer")
    assert result.returncode == 0, result.stderr
    rows = result.stdout.strip().splitlines()[2:]
    assert [r.split("  ")[0] for r in rows[:2]] == ["ReversibleTrainer", "StandardTrainer"], rows

    workdir = tmp_path / "run"
    result = revtrain_here(capsys, "train", "--config", LLAMA, *SHORT, *tiny, "--workdir", str(workdir))
    assert result.returncode == 0, result.stderr
    assert "memory plan (StandardTrainer, " in result.stderr
    assert "host RSS " in result.stderr
    records = [json.loads(line) for line in open(workdir / "metrics" / "train.jsonl")]
    first = records[0]
    assert first["plan_fits"] is True and first["plan_host_bytes"] > planning.RUNTIME_BYTES
    assert first["host_limit_bytes"] > first["plan_host_bytes"]
    assert all(0 < r["host_resident_bytes"] <= r["host_peak_bytes"] for r in records)
    assert "plan_host_bytes" not in records[1]  # only the first record
    # The same run, planned off: no plan fields.
    result = revtrain_here(capsys, "train", "--config", LLAMA, *SHORT, *tiny, "--gin", "train.memory_plan = False",
                           "--workdir", str(tmp_path / "off"))
    assert result.returncode == 0, result.stderr
    assert "plan_host_bytes" not in json.loads(open(tmp_path / "off" / "metrics" / "train.jsonl").readline())


# ------------------------------------------------------------------------------------------------
# `revtrain plan` with a memory budget runs the budget's planner (issue 53: it said "fits" where train crashed).
# ------------------------------------------------------------------------------------------------
MODERN = ["--config", str(REPO / "configs" / "enwik_modern.gin"), "--gin", "NUM_LAYERS = 2", "--gin", "D_MODEL = 32",
          "--gin", "train.batch_size = 8", "--gin", "STEPS = 6", "--gin", "WARMUP = 1",
          "--gin", "ReversibleTrainer.budget_objective = 'flops'"]  # (the same plan on every machine)
BUDGET_ROWS = [pytest.param("tied", ["RMSNormLanguageModelHead.tie_embedding = True"], "ReversibleTrainer",
                "0 backprop, 0 checkpoint, 2 remat, 0 rebuild", marks=pytest.mark.slow),
               pytest.param("disk tier",
                            ["ReversibleTrainer.offload = 'disk'", "ReversibleTrainer.scan_layers = False"],
                            "ReversibleTrainer + offload='disk'", "2 backprop, 0 checkpoint, 0 remat, 0 rebuild",
                            marks=pytest.mark.slow),
               pytest.param("host tier, scanned", ["ReversibleTrainer.offload = True"], "ReversibleTrainer + offload",
                            "2 backprop, 0 checkpoint, 0 remat, 0 rebuild", marks=pytest.mark.slow)]


@pytest.mark.parametrize("row, bindings, label, blocks", BUDGET_ROWS)
def test_plan_with_a_budget_runs_the_budget_planner(row, bindings, label, blocks, tmp_path, capsys, monkeypatch):
    """``revtrain plan`` with ``memory_budget`` on the default model with tied embeddings (the disk tier, and the
    host tier with the scanned executor, in make test-all: a few minutes each on 2 busy cores): the budget
    plan's line first (what ``train`` logs), then the memory plan that counts its expected peak; a budget
    below the least is refused in one line with exit 2, naming the least, as ``train`` refuses it."""
    monkeypatch.chdir(tmp_path)  # (the disk tier's default offload directory: ./offload)
    gin = [a for b in bindings for a in ("--gin", b)]
    result = revtrain_here(capsys, "plan", *MODERN, *gin, "--gin", "ReversibleTrainer.memory_budget = '200MiB'")
    assert result.returncode == 0, result.stderr
    out = result.stdout.strip().splitlines()
    assert out[0].startswith(f"memory budget 200.0 MiB: blocks {blocks} (exact); expected peak "), (row, out[0])
    assert out[1].startswith(f"memory plan ({label}, ") and out[1].endswith("; fits"), (row, out[1])
    assert "the memory budget's plan of the step" in out[-1]
    result = revtrain_here(capsys, "plan", *MODERN, *gin, "--gin", "ReversibleTrainer.memory_budget = '64KiB'")
    assert result.returncode == 2, result.stderr
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("revtrain: error: ReversibleTrainer.memory_budget 0.1 MiB is "
                                                     "below the least this step needs: "), errors
    assert "raise it to at least" in errors[0] and result.stdout == ""


def test_train_refuses_a_budget_below_the_least_with_exit_2(tmp_path):
    """``revtrain train`` (a process of its own) with the tied row's budget below the least plan's peak: exit
    2, one error line naming the least budget, no traceback, before the state is placed (no checkpoint, the
    new workdir removed). (Run after the test above, its programs come from the session's compilation cache:
    about 20 s less than compiling the planner's candidates afresh.)"""
    workdir = tmp_path / "w"
    result = revtrain("train", *MODERN, "--gin", "RMSNormLanguageModelHead.tie_embedding = True",
                      "--gin", "ReversibleTrainer.memory_budget = '64KiB'", "--workdir", workdir)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("revtrain: error: ")]
    assert len(errors) == 1 and "memory_budget 0.1 MiB" in errors[0], errors
    assert "is below the least this step needs" in errors[0] and "raise it to at least" in errors[0], errors
    assert "Traceback" not in result.stderr
    assert not workdir.exists()


@pytest.fixture
def compiles(monkeypatch):
    """A function that says how many programs were compiled (``jax.jit(...).lower(...).compile()``, as
    `_Programs` does; a hit in the persistent compilation cache counts too) since the test began."""
    calls, real = [], jax.stages.Lowered.compile

    def compile_(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_)
    return lambda: len(calls)


def test_the_floor_is_a_lower_bound_of_the_plan_from_shapes_alone(model, shared, compiles, tmp_path):
    """`floor`: the plan's weights, optimizer state and gradients (and the reversible trainer's activations) in
    the same tiers, nothing compiled; every tier's total at most the compiled plan's."""
    tx, programs = shared  # (one compile cache for the module's plans)
    weights, opt, largest = _exact(model)
    gpu = {"host": (2**50, "t"), "device": (2**40, "t")}
    disk = {}  # (the disk tier's directory is its own)
    cases = [(planning.Setup("standard", tx, B), 1, "cpu"), (planning.Setup("standard", tx, B, 2), 1, "cpu"),
             (planning.Setup("standard", tx, B), 1, "gpu"), (planning.Setup("reversible", tx, B), 1, "cpu"),
             (planning.Setup("reversible", tx, B, deferred=True), 1, "cpu"),
             (planning.Setup("reversible", tx, B, tier=_host(pageable=False)), 1, "gpu"),
             (planning.Setup("reversible", tx, B, tier=_host(), shard_state=True, deferred=True), 2, "cpu"),
             (planning.Setup("reversible", tx, B, tier=_disk(tmp_path), deferred=True), 1, "gpu")]
    floors = [planning.floor(model, s, _spec(B), n, limits=gpu if p == "gpu" else NO_LIMIT, platform=p, store=disk)
              for s, n, p in cases]
    assert compiles() == 0
    for (setup, n, platform), low in zip(cases, floors):
        full = planning.plan(model, setup, _spec(B), n, limits=gpu if platform == "gpu" else NO_LIMIT,
                                programs=programs, platform=platform, store=disk)
        assert low.floor and not full.floor and list(low.tiers) == list(full.tiers), setup
        for tier, parts in low.tiers.items():
            assert low.total(tier) <= full.total(tier), (setup, tier)
            for part in ("weights", "optimizer_state", "runtime"):
                assert parts.get(part, 0) == full.tiers[tier].get(part, 0), (setup, tier, part)
            if setup.trainer == "reversible":
                assert parts.get("gradients", 0) == full.tiers[tier].get("gradients", 0), (setup, tier)
                assert parts.get("activations", 0) == full.tiers[tier].get("activations", 0), (setup, tier)
    standard = floors[0].tiers["host"]
    assert standard["weights"] == weights and standard["optimizer_state"] == opt
    assert standard["gradients"] == weights == floors[1].tiers["host"]["gradients"]  # the tree once
    assert standard["activations"] == 0  # (the residuals are the compiled step's)
    assert standard["temporaries"] == int(planning.STANDARD_EXTRA_FRACTION * weights)
    assert floors[4].tiers["host"]["gradients"] == weights + largest  # the deferred buffer beside one layer's
    assert floors[5].tiers["device"]["weights"] == 4 * largest  # a GPU: the state in the pinned pool
    assert floors[5].tiers["pinned"]["weights"] == weights + largest


TINY_RUN = [*SHORT, "--gin", "evaluate.batch_size = 2", "--gin", "LlamaModel.d_model = 128",
            "--gin", "LlamaModel.num_layers = 4", "--gin", "LlamaModel.d_ff = 256"]


@pytest.mark.slow  # make test: the refusals below (settings that fit, a memory cgroup, a budget below the least)
def test_a_state_over_the_limit_is_refused_from_shapes_with_the_compiled_line(byte_lm_data_dir, monkeypatch,
                                                                               compiles):
    """A StandardTrainer run whose weights, optimizer state and gradients exceed the limit given to
    `check_everywhere` is refused before its step is compiled, in the line the compiled plans give (the same
    settings that would fit; its own parts those the compiled plan has, less the temporaries and residuals);
    below every choice's floor nothing at all is compiled."""
    import gin

    from revtrain import cli, loop
    monkeypatch.setattr("revtrain.limits.ASYNC_MAX_BYTES", 0)  # a save between steps, no staging: the state counts
    monkeypatch.setattr("revtrain.limits.STAGING_BYTES", 0)
    cli._parse_gin([LLAMA], [b for b in TINY_RUN if b != "--gin"])
    try:
        run = loop.build()
    finally:
        gin.clear_config()
    spec, programs = run.task.input_spec(2), planning.PlanPrograms()
    setups = planning.alternatives(planning.setup_of(run.trainer, 2), run.model, 1, True)
    half = next(s for s in setups if s.trainer == "standard")  # StandardTrainer at batch 1: a floor below the run's

    def refused(limits):
        with pytest.raises(planning.MemoryPlanError) as e:
            planning.check_everywhere(run, limits=limits)
        return str(e.value)

    def compiled(limits):  # what the plan said before the floor: every choice compiled
        own = planning.plan_run(run, limits, programs)
        others = [planning.plan(run.model, s, spec, 1, limits=limits, programs=programs, global_devices=1,
                                   eval_spec=planning.runs._eval_spec(run), store=planning.runs._store_spec(run))
                  for s in setups]
        return own, others

    # Below StandardTrainer's floor (at batch 1 too), above the reversible trainer's: no step is compiled.
    limit = planning.floor(run.model, half, spec, 1, limits=NO_LIMIT).total("host") - 1
    limits = {"host": (limit, "test limit")}
    own, others = compiled(limits)
    assert not own.fits and any(p.fits for p in others)
    expected = planning.refusal(own, others)
    assert "these settings would fit: " in expected
    with monkeypatch.context() as patch:
        patch.setattr(planning.PlanPrograms, "whole_step", lambda *a: pytest.fail("a whole step was compiled"))
        line = refused(limits)
    low = planning.floor_run(run, limits)
    assert line == planning.refusal(low, others)
    assert line.split("); ", 1)[1] == expected.split("); ", 1)[1]  # the same settings would fit
    assert line.startswith("the memory plan does not fit: StandardTrainer host needs at least ")
    for part in ("weights", "optimizer_state", "gradients", "runtime"):  # the compiled plan's parts
        assert low.tiers["host"][part] == own.tiers["host"][part]
        assert f"{part.replace('_', ' ')} {planning.gib(own.tiers['host'][part])}" in line

    # Below every choice's floor (the runtime alone): nothing is compiled at all.
    limits = {"host": (planning.RUNTIME_BYTES, "test limit")}
    before = compiles()
    line = refused(limits)
    assert compiles() == before
    own, others = compiled(limits)  # (compiled above)
    low = planning.floor_run(run, limits)
    assert not low.fits and "runtime alone" in line
    assert line == planning.refusal(low, others)
    assert line.split("); ", 1)[1] == planning.refusal(own, others).split("); ", 1)[1]


def test_a_state_over_the_pinned_pool_is_refused_naming_the_limit(model, shared, monkeypatch):
    """On a GPU a pool preallocated below the plan's pinned need is refused in one line that names the limit
    to set."""
    tx, programs = shared
    monkeypatch.setenv(pinned.PREALLOCATE_ENV, "true")
    monkeypatch.setenv(pinned.LIMIT_ENV, "0")
    setup = planning.Setup("reversible", tx, B, tier=_host(pageable=False), label="s")  # (a GPU's: pinned)
    own = planning.plan(model, setup, _spec(B), 1, limits={"host": (2**50, "t"), "device": (2**40, "t")},
                           platform="gpu", programs=programs)
    assert not own.fits and own.tiers["pinned"]["pool"] == 0
    line = planning.refusal(own, [])
    assert line.startswith("the memory plan does not fit: s pinned needs ")
    assert "of 0 MiB (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=0, preallocated)" in line
    assert "set XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=2 (revtrain train sizes the pool from the state alone" in line
    assert "\n" not in line
