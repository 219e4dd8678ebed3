"""Every knob with every other (issue 53): a pairwise matrix over the memory knobs (tier, budget, executor,
rebuild, sharded state) and the recipe knobs (microbatches, global-norm clipping, tied embeddings, optimizer),
generated from `KNOBS` by a small all-pairs generator (`all_pairs`): a new knob joins the matrix by one line.

Each cell is a ``revtrain train`` run of the default model (configs/enwik_modern.gin, on its fixed-point grid) at
depth 2, d_model 32, 4 steps, a checkpoint every 2. A cell passes when it either

* trains bit for bit like its reference, ``StandardTrainer`` with the same recipe knobs on as many devices
  (losses of every step and final weights equal; so also like the same recipe without the memory knobs); for
  the values the project promises only within a tolerance of StandardTrainer (`NOT_BITWISE`: tied embeddings,
  the fenced rebuild), bit for bit like the reversible trainer of the same recipe without the other memory
  knobs, and that within the tolerance of StandardTrainer; or
* is refused in one line with exit status 2 (no traceback) before it trains.

A crash (exit 1, a traceback) or a mismatch fails the cell (issue 53 found three: a budget beside the disk tier,
beside the host tier's scanned executor, beside tied embeddings). Cells on one device run in this process (`helpers.revtrain_here`:
no interpreter to start, programs compiled once); those with ``shard_state`` run on 2 simulated devices in a
subprocess, beside references on 2 devices. `make test` runs `FAST`, a subset of the pairwise cells in which
every value of `FAST_KNOBS` (the optimizer) appears; `make test-all` runs every pairwise cell and, in each
cell that trains, a ``kill -9`` after the step-2 checkpoint and a rerun that must reach the uninterrupted run's
losses and final weights (this file is also the killed run's script: ``python tests/test_combinations.py
WORKDIR STEP -- REVTRAIN_ARGS...``).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest

# name: (gin binding, values as gin literals; the first is the default, the reference's).
KNOBS = {
    "offload": ("ReversibleTrainer.offload", ["False", "True", "'disk'"]),
    "memory_budget": ("ReversibleTrainer.memory_budget", ["None", "'256MiB'"]),
    "scan_layers": ("ReversibleTrainer.scan_layers", ["True", "False"]),
    "rebuild": ("ReversibleTrainer.rebuild", ["'exact'", "'fused'", "'fenced'"]),
    "shard_state": ("ReversibleTrainer.shard_state", ["False", "True"]),
    "microbatches": ("train.microbatches", ["1", "2"]),
    "clip_global_norm": ("train.clip_global_norm", ["None", "0.5"]),
    "tie_embedding": ("RMSNormLanguageModelHead.tie_embedding", ["False", "True"]),
    "optimizer": ("train.optimizer", ["@optax.adamw", "@optax.lion"]),
}
# The knobs of the trainer (reset in a cell's reference); the others are the recipe's.
MEMORY = ("offload", "memory_budget", "scan_layers", "rebuild", "shard_state")
# Needs 2 devices (the cell and its references run in a subprocess with 2 simulated CPU devices).
TWO_DEVICES = {("shard_state", "True")}

STEPS, EVERY = 4, 2
BASE = ["--config", "configs/enwik_modern.gin", "--gin", "NUM_LAYERS = 2", "--gin", "D_MODEL = 32",
        "--gin", "train.batch_size = 8", "--gin", f"STEPS = {STEPS}", "--gin", "WARMUP = 1",
        "--gin", "train.log_every = 1", "--gin", f"train.checkpoint_every = {EVERY}", "--gin", "train.sample_every = 0",
        "--gin", "evaluate.max_batches = 1", "--gin", "train.trainer = @ReversibleTrainer",
        # A budget's plan from compiled FLOPs: the same plan on every machine (the time objective times programs).
        "--gin", "ReversibleTrainer.budget_objective = 'flops'"]
STANDARD = ["--gin", "train.trainer = @StandardTrainer"]

# Values the project promises within a tolerance of StandardTrainer, not bit for bit (tolerance, where it says so):
# a cell holding one is compared bit for bit with the reversible trainer on the same recipe without the other
# memory knobs, and that run with StandardTrainer within the tolerance (losses and final weights, relative).
NOT_BITWISE = {
    ("tie_embedding", "True"): (1e-6, "docs/recipe.md: a tied embedding/head is within 1e-6 of StandardTrainer"),
    ("rebuild", "'fenced'"): (1e-6, "docs/rebuild.md: the fenced forward does not round like backprop's"),
}

# ------------------------------------------------------------------------------------------------
# The matrix.
# ------------------------------------------------------------------------------------------------
def all_pairs(knobs: dict, requires: dict | None = None) -> list[dict]:
    """The pairwise matrix: one cell (``{name: value}`` of every knob) per pair of non-default values of two
    different knobs, every other knob at its default, in `KNOBS` order. A pair with a default value is then
    in the cells of the non-default one with a third knob. Each knob's values are ``knobs[name][1]``, the
    first the default. ``requires``: ``{(name, value): {other: value}}``, set in every cell holding that value
    (a knob that needs another's value to run at all, so its refusal does not hide the pair).

    One knob changed at a time would miss what the issue found (a budget crashes only beside the disk tier, or
    tied embeddings); a covering array that changes every knob in every cell would let one refusal hide the
    other pairs of its cell. Here a cell is refused or crashes for its own pair."""
    requires = requires or {}
    items = [(n, v) for n in knobs for v in knobs[n][1][1:]]
    cells = []
    for (a, x), (b, y) in itertools.combinations(items, 2):
        if a == b:
            continue
        cell = {n: knobs[n][1][0] for n in knobs}
        for n, v in ((a, x), (b, y)):
            for m, w in requires.get((n, v), {}).items():
                cell[m] = w
        cell[a], cell[b] = x, y
        if cell not in cells:
            cells.append(cell)
    return cells


def every_value(cells: list[dict], knobs: dict, refs=lambda c: ()) -> list[dict]:
    """A few of ``cells`` in which every non-default value of every knob appears, the fast tier's choice:
    greedily the cell showing the most values not yet shown, then the one
    needing the fewest reference runs not needed yet (``refs(cell)``: their keys), then the first."""
    missing = {(n, v) for n in knobs for v in knobs[n][1][1:]}
    chosen, have = [], set()
    while missing:
        best = max(cells, key=lambda c: (sum((n, v) in missing for n, v in c.items()),
                                         -len(set(refs(c)) - have)))
        chosen.append(best)
        missing -= set(best.items())
        have |= set(refs(best))
    return chosen


def name_of(cell: dict) -> str:
    """The cell's test id: its knobs away from their defaults (``defaults``: none)."""
    changed = [f"{n}={v.strip(chr(39))}" for n, v in cell.items() if v != KNOBS[n][1][0]]
    return ",".join(changed) or "defaults"


def devices_of(cell: dict) -> int:
    return 2 if any(item in TWO_DEVICES for item in cell.items()) else 1


def bindings(cell: dict) -> list[str]:
    """The cell's ``--gin`` arguments (its knobs away from their defaults)."""
    out = []
    for n, v in cell.items():
        if v != KNOBS[n][1][0]:
            out += ["--gin", f"{KNOBS[n][0]} = {v}"]
    return out


def recipe_of(cell: dict) -> dict:
    """The cell with its memory knobs at their defaults (the recipe kept): what StandardTrainer runs."""
    return {n: (KNOBS[n][1][0] if n in MEMORY else v) for n, v in cell.items()}


def reference_of(cell: dict) -> dict:
    """The cell's reference: `recipe_of`, but a memory knob's value that `NOT_BITWISE` names kept (its run is
    then compared bit for bit with the reversible trainer of that value, and that one within the tolerance with
    StandardTrainer)."""
    return {n: (v if n not in MEMORY or (n, v) in NOT_BITWISE else KNOBS[n][1][0]) for n, v in cell.items()}


def _reference_key(cell: dict) -> tuple:
    return (tuple(sorted(reference_of(cell).items())), devices_of(cell))


# The disk tier runs the per-layer executor (its refusal of the scanned one: tests/test_disk_tier.py).
REQUIRES = {("offload", "'disk'"): {"scan_layers": "False"}}
CELLS = [{n: KNOBS[n][1][0] for n in KNOBS}] + all_pairs(KNOBS, REQUIRES)


def _marks(cell: dict, slow: bool) -> list:
    return [pytest.mark.slow] if slow else []


# The fast tier: the second optimizer's cell (on the host tier, as the generator picks it). The other knobs' values
# have their own tests in make test (every tier: test_streaming, test_disk_tier's recipe; a budget on every tier:
# test_budget; the rebuild flavours: test_modes, test_rebuild; microbatches and clipping: test_exactness; tied
# embeddings: test_recipe; shard_state: test_shard); their pairs run in make test-all.
FAST_KNOBS = ("optimizer",)
FAST = every_value([c for c in CELLS if devices_of(c) == 1], {n: k for n, k in KNOBS.items() if n in FAST_KNOBS},
                   refs=lambda c: [_reference_key(c), (name_of(c), devices_of(c))])


def _params(cells: list[dict], slow: bool) -> list:
    return [pytest.param(c, id=name_of(c), marks=_marks(c, slow)) for c in cells]


# ------------------------------------------------------------------------------------------------
# Running a cell.
# ------------------------------------------------------------------------------------------------
class Outcome:
    """What a run did: ``trained`` (losses by step, final weights per layer as lists of numpy arrays) or
    ``refused`` (its one line); a crash fails the test where it is made."""

    def __init__(self, code: int, err: str, workdir: pathlib.Path, what: str):
        self.code, self.err, self.workdir, self.what = code, err, workdir, what
        lines = err.strip().splitlines()
        if code == 2:
            assert len(lines) == 1 and "Traceback" not in err, f"{what}: refused in more than one line:\n{err[-3000:]}"
            assert not (workdir / "metrics" / "train.jsonl").exists(), f"{what}: refused after it trained"
            self.line = lines[0]
            return
        assert code == 0, f"{what}: crashed (exit {code}):\n{err[-3000:]}"
        from helpers import losses
        self.losses = losses(workdir)
        assert sorted(self.losses) == list(range(1, STEPS + 1)), f"{what}: {self.losses}"
        self.weights = final_weights(workdir, STEPS)

    @property
    def trained(self) -> bool:
        return self.code == 0


def final_weights(workdir: pathlib.Path, step: int) -> list[list]:
    """The weights of the checkpoint of ``step``, per layer, each layer's leaves in ``jax.tree.leaves`` order
    (numpy): from the Orbax ``state`` item, or a disk-tier checkpoint's layer files (their index's layouts)."""
    item = pathlib.Path(workdir) / "checkpoints" / str(step)
    if (item / "disk_state").is_dir():
        from revtrain.tiers import disk_format
        from revtrain.tiers import disk_links
        index = json.loads((item / "disk_state" / disk_links.INDEX).read_text())
        out = []
        for entry in index["layers"]:
            layout = disk_links._saved_layout(entry)
            out.append(disk_format.read_leaves(str(item / "disk_state" / entry["file"]), layout, "params"))
        return out
    import jax
    import orbax.checkpoint as ocp
    path = (item / "state").resolve()
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:  # as numpy: any device count saved it
        tree = reader.metadata(path).item_metadata.tree
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        tree = reader.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
    return [[np.asarray(x) for x in jax.tree.leaves(layer)] for layer in tree["params"]]


def _same_weights(a: list, b: list) -> bool:
    return len(a) == len(b) and all(len(p) == len(q) and all(x.shape == y.shape and np.array_equal(x, y)
                                                             for x, y in zip(p, q)) for p, q in zip(a, b))


def _train(args: list, workdir: pathlib.Path, devices: int, capfd) -> tuple[int, str]:
    """``revtrain train ARGS --workdir WORKDIR``: in this process (one device) or a subprocess (several)."""
    from helpers import REPO, revtrain, revtrain_here
    full = ["train", *args, "--workdir", str(workdir)]
    if devices == 1:
        cwd = os.getcwd()
        os.chdir(REPO)  # (the config path is relative to the checkout)
        try:
            result = revtrain_here(capfd, *full)
        finally:
            os.chdir(cwd)
    else:
        result = revtrain(*full, cwd=REPO, devices=devices, timeout=600, JAX_PLATFORMS="cpu")
    return result.returncode, result.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``run(cell, standard, devices, capfd)``: the `Outcome` of a cell's run, each trained once per module
    (references are shared between cells); ``capfd`` is the calling test's (function scoped)."""
    cache, root = {}, tmp_path_factory.mktemp("combinations")

    def run(cell: dict, standard: bool, devices: int, capfd) -> Outcome:
        key = (standard, tuple(sorted(cell.items())), devices)
        if key not in cache:
            what = ("standard " if standard else "") + name_of(cell) + f" ({devices} device(s))"
            workdir = root / f"run{len(cache)}"
            args = [*BASE, *bindings(cell), *(STANDARD if standard else [])]
            code, err = _train(args, workdir, devices, capfd)
            cache[key] = Outcome(code, err, workdir, what)
        return cache[key]

    return run


def check_cell(cell: dict, runs, capfd) -> Outcome:
    """Runs ``cell``; asserts it trains bit for bit like StandardTrainer with the same recipe knobs on as many
    devices (losses of every step, final weights), or is refused in one line with exit status 2. (Equal to
    StandardTrainer is equal to the same recipe without the memory knobs too, which must equal it: one
    reference run instead of two.) A cell with a `NOT_BITWISE` value: bit for bit like the reversible trainer
    of `reference_of`, and that within the value's tolerance of StandardTrainer."""
    devices = devices_of(cell)
    out = runs(cell, False, devices, capfd)
    if os.environ.get("REVTRAIN_COMBINATIONS_OUT"):  # a record of what each cell did, for a report
        with open(os.environ["REVTRAIN_COMBINATIONS_OUT"], "a") as f:
            f.write(f"{out.what}: " + ("trains\n" if out.trained else f"refused: {out.line}\n"))
    if not out.trained:
        return out
    loose = [NOT_BITWISE[item] for item in cell.items() if item in NOT_BITWISE]
    ref = out
    if loose and reference_of(cell) != cell:
        ref = runs(reference_of(cell), False, devices, capfd)
        assert ref.trained, f"{out.what} trains, its reference {ref.what} is refused: {ref.line}"
        assert out.losses == ref.losses, f"{out.what} against {ref.what}:\n{out.losses}\n{ref.losses}"
        assert _same_weights(out.weights, ref.weights), f"{out.what}: final weights differ from {ref.what}'s"
    std = runs(recipe_of(cell), True, devices, capfd)
    assert std.trained, f"{ref.what} trains, its reference {std.what} is refused: {std.line}"
    if loose:
        tol = max(t for t, _ in loose)
        assert _relative(list(ref.losses.values()), list(std.losses.values())) <= tol, (ref.losses, std.losses)
        assert _worst(ref.weights, std.weights) <= tol, f"{ref.what} against {std.what}"
        return out
    assert out.losses == std.losses, f"{out.what} against {std.what}:\n{out.losses}\n{std.losses}"
    assert _same_weights(out.weights, std.weights), f"{out.what}: final weights differ from {std.what}'s"
    return out


def _relative(a: list, b: list) -> float:
    return max(abs(x - y) / max(abs(x), 1e-30) for x, y in zip(a, b, strict=True))


def _worst(a: list, b: list) -> float:
    """max over leaves of max |a - b| / max |a| (weights per layer, as `final_weights`)."""
    assert [len(p) for p in a] == [len(q) for q in b]
    return max((float(np.abs(x - y).max() / max(np.abs(x).max(), 1e-30)) for p, q in zip(a, b) for x, y in zip(p, q)
                if x.size), default=0.0)


def test_the_matrix_covers_every_pair():
    """The generated cells cover every pair of values of two knobs (a value another requires: with it); the
    fast subset every value of `FAST_KNOBS`."""
    for a, b in itertools.combinations(KNOBS, 2):
        for x, y in itertools.product(KNOBS[a][1], KNOBS[b][1]):
            forced = {**REQUIRES.get((a, x), {}), **REQUIRES.get((b, y), {})}
            if forced.get(a, x) != x or forced.get(b, y) != y:
                continue
            assert any(c[a] == x and c[b] == y for c in CELLS), (a, x, b, y)
    for n in FAST_KNOBS:
        assert set(KNOBS[n][1][1:]) <= {c[n] for c in FAST}, n
    assert all(sum(c[n] != KNOBS[n][1][0] for n in KNOBS) <= 3 for c in CELLS)
    knobs = {"a": ("a", [0, 1]), "b": ("b", [0, 1, 2]), "c": ("c", [0, 1])}
    assert all_pairs(knobs) == [{"a": 1, "b": 1, "c": 0}, {"a": 1, "b": 2, "c": 0}, {"a": 1, "b": 0, "c": 1},
                                {"a": 0, "b": 1, "c": 1}, {"a": 0, "b": 2, "c": 1}]


@pytest.mark.parametrize("cell", _params(FAST, slow=False))
def test_cell(cell, runs, capfd):
    check_cell(cell, runs, capfd)


@pytest.mark.parametrize("cell", _params([c for c in CELLS if c not in FAST], slow=True))
def test_cell_slow(cell, runs, capfd):
    check_cell(cell, runs, capfd)


@pytest.mark.slow
@pytest.mark.parametrize("cell", _params(CELLS, slow=True))
def test_kill_9_after_a_checkpoint_resumes_exactly(cell, runs, capfd, tmp_path):
    """A run of the cell killed (SIGKILL) once its step-2 checkpoint is committed, then rerun: the rerun resumes
    from step 2 and reaches the uninterrupted run's losses of every step and final weights."""
    from helpers import REPO, env, losses
    out = check_cell(cell, runs, capfd)
    if not out.trained:
        pytest.skip(f"refused: {out.line}")
    workdir = tmp_path / "killed"
    args = ["train", *BASE, *bindings(cell), "--workdir", str(workdir)]
    killed = subprocess.run([sys.executable, __file__, str(workdir), str(EVERY), "--", *args], cwd=REPO,
                            capture_output=True, text=True, timeout=600,
                            env=env(devices_of(cell) if devices_of(cell) > 1 else None, JAX_PLATFORMS="cpu"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    code, err = _train(args[1:-2], workdir, devices_of(cell), capfd)
    assert code == 0, err[-3000:]
    assert f"resumed from checkpoint at step {EVERY}" in err
    assert losses(workdir) == out.losses
    assert _same_weights(final_weights(workdir, STEPS), out.weights)


def _kill_after_checkpoint(workdir: str, step: int, argv: list[str]) -> int:
    """``revtrain ARGV`` that kills itself (SIGKILL) when the step after ``step`` starts, once ``step``'s
    checkpoint is committed (its directory exists)."""
    import time

    from revtrain import cli
    from revtrain.trainers.common import TrainerBase
    committed = pathlib.Path(workdir) / "checkpoints" / str(step)

    def patch(cls):
        original = cls.train_step

        @functools.wraps(original)
        def train_step(self, ts, *a, **k):
            if ts.step == step:
                deadline = time.monotonic() + 120
                while not committed.is_dir() and time.monotonic() < deadline:
                    time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGKILL)
            return original(self, ts, *a, **k)
        cls.train_step = train_step

    for cls in {c for c in TrainerBase.__subclasses__()} | {c for s in TrainerBase.__subclasses__()
                                                            for c in s.__subclasses__()}:
        if "train_step" in vars(cls):
            patch(cls)
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(_kill_after_checkpoint(sys.argv[1], int(sys.argv[2]), sys.argv[sys.argv.index("--") + 1:]))
