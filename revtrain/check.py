"""``revtrain check``: is reversible training exact for *this* model, depth, width, dtype and data?

One step of each trainer from the same parameters on one real batch of the configured task, compared per
layer:

* **rebuild error** of each reversible layer: ``max |x_rebuilt - x| / max |x|`` over both streams, where
  ``x`` is the input the forward pass saw and ``x_rebuilt`` what the backward pass rebuilt from the layer's
  (itself rebuilt) output, exactly as ``ReversibleTrainer`` does; the error accumulates with depth until the
  next standard layer.
* **gradient difference**: ``max |g_rev - g_ref| / max |g_ref|`` over the layer's parameters, where
  ``g_ref`` is ordinary backprop (the whole model at once, or ``check.layers_per_chunk`` layers at a time
  for models too large for one backprop: each chunk is differentiated at its true forward input), in the
  same compute dtype.
* **optimizer step** (`revtrain.check_optimizer`): each layer's optimizer step (new parameters and optimizer
  state, as ReversibleTrainer runs it) against the whole model's (StandardTrainer's), bit for bit over a few
  steps of seeded gradients; the first step, layer and leaf that differ fail the check.

The passes walk down the layers together (`_Checker.rows`), so the check holds the weights and one layer's
gradients, never the whole model's: it runs on the largest model that trains (docs/memory.md).

Both are shown for float32 and bfloat16 compute when the model builder takes ``compute_dtype``. The
parameters are the model's initial ones, or a trained checkpoint's (``revtrain check --workdir DIR``).

Verdict: every layer within the tolerance of the configured compute dtype (``TOLERANCE``) -> exit 0;
otherwise exit 1 naming the worst layer. A note line before it says what to change when the residual
streams left the fixed-point grid's exact range (``grid_bits``), or when only gradients are out of
tolerance while every rebuild is exact (then it is backprop's own rounding: see ``layers_per_chunk=1``).
"""

from __future__ import annotations

import inspect
import math
import sys

import gin
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from revtrain import check_optimizer
from revtrain import run as run_lib
from revtrain.placement import DATA_AXIS, global_batch, put_replicated
from revtrain.trainers.common import batch_size_of, example_keys, per_device, step_key
from revtrain.trainers.modes import REBUILDS, count_in_head, default_modes, mode_named
from revtrain.trainers.programs import LayerPrograms, compile_on
from revtrain.trainers.reversible import ReversibleTrainer

# Relative tolerances (rebuild error, gradient difference) by compute dtype, each against backprop in the
# same dtype. float32: the 1e-5 for both. Measured on the default model (6 blocks, d_model 128) at
# initialisation, after 300 steps in bfloat16 and after 700 steps in float32: the rebuild is 0.0 in both
# precisions (the weights, optimizer state and residual streams are float32 under bfloat16 compute too),
# so bfloat16's rebuild tolerance is float32's. Gradients against whole-model backprop: float32 <= 7.2e-6,
# bfloat16 <= 3.8e-2. That is not reversibility: ordinary backprop run one layer at a time
# (``check.layers_per_chunk = 1``) differs from whole-model backprop by the same amounts, layer for layer
# (bfloat16 up to 3.9e-2 two layers at a time), and the reversible trainer's gradients equal that
# layer-at-a-time backprop bit for bit. bfloat16 gradient tolerance 5e-2 (set in the first measurement, from
# initial weights; still 1.3x above the worst trained case).
TOLERANCE = {"float32": (1e-5, 1e-5), "bfloat16": (1e-5, 5e-2)}

_R, _D = P(), P(DATA_AXIS)


def _rel(a, b) -> float:
    a = [np.asarray(x, np.float64) for x in jax.tree.leaves(a)]
    b = [np.asarray(x, np.float64) for x in jax.tree.leaves(b)]
    if not a:
        return 0.0
    scale = max(float(np.abs(x).max()) for x in a)
    diff = max(float(np.abs(x - y).max()) for x, y in zip(a, b))
    return diff / scale if scale > 0 else diff


class _Checker:
    """Runs the two gradient computations of one model on one batch (inside shard_map over "data").

    The reversible trainer's passes are its own programs: the program interface's (`LayerPrograms.on_mesh`
    of the model on the mesh, one per rebuild mode), its forward programs and its gradient-only programs
    (``head_grads``, ``rebuild_grads``, ``recompute_grads``, `LayerPrograms.top_head_grads_program`: the
    trainer's per-layer programs without the update); only the backprop reference is declared here. Every
    program is compiled once per distinct layer (structurally identical layers compare equal, see
    `revtrain.layers.base.Layer`) and takes the layer's index as an argument (its dropout keys), so a model
    of 48 identical blocks compiles each pass's block program once, as the trainer does. ``progress(text)``
    is called after each layer of each pass ("forward", "reversible backward (exact rebuild)", "backprop").
    """

    def __init__(self, model, mesh, seed: int, progress=None):
        self.model, self.mesh, self.seed = model, mesh, seed
        self.layers = model.layers
        self.skey = step_key(seed, 0)
        self.progress = progress or (lambda text: None)
        self._compile = compile_on(mesh)  # (the program interface's compile function, `LayerPrograms.compile`)
        self._programs: dict = {}

    def programs(self, rebuild: str = "exact") -> LayerPrograms:
        """The trainer's programs of this model on the mesh with the rebuild mode ``rebuild`` (made once; the
        gradient-only programs never read the optimizer: ``optax.identity()`` stands for it)."""
        if rebuild not in self._programs:
            import optax
            self._programs[rebuild] = LayerPrograms.on_mesh(self.model, optax.identity(), self.mesh, rebuild)
        return self._programs[rebuild]

    def _sharded(self, key, fn, in_specs, out_specs):
        """``fn`` compiled over the mesh (``jit(shard_map(fn))``, once per ``key``), as the trainer's programs
        are (`revtrain.trainers.programs.compile_on`)."""
        return self._compile(key[0], key[1:], lambda _, *args: fn(*args), in_specs, out_specs, key=key)

    def _keys(self, i, x):
        return example_keys(self.skey, i, batch_size_of(x))

    def _tell(self, what: str, done: int, total: int) -> None:
        every = max(1, total // 8)
        if done % every == 0 or done == total:
            self.progress(f"{what}: {done} of {total} layers")

    def _forward_program(self, layer, mode=REBUILDS["exact"]):
        """The trainer's forward program of ``layer`` in ``mode`` (a `modes.BackwardMode` or a rebuild mode's
        name; a fenced rebuild's residuals dropped, as the trainer drops them): ``(params, state, x, index) ->
        y``."""
        if isinstance(mode, str):
            mode = REBUILDS[mode]
        programs = self.programs(mode.name if mode.rebuilds else "exact")
        program = programs.per_layer(mode.program_kinds[0], layer)
        return lambda p, s, x, i: program(p, s, x, self.skey, i)[0]

    def forward_inputs(self, params, states, batch):
        """The input of every layer in the forward pass (host numpy copies) and the head's input."""
        inputs, x = [], batch[self.model.input_key]
        n = len(self.layers)
        for i, layer in enumerate(self.layers[:-1]):
            inputs.append(jax.tree.map(np.asarray, x))
            x = self._forward_program(layer)(params[i], states[i], x, np.int32(i))
            self._tell("forward", i + 1, n)
        inputs.append(jax.tree.map(np.asarray, x))
        self._tell("forward", n, n)  # (the head's input is the last forward output)
        return inputs

    def block_modes(self, rebuild: str = "exact", modes=None) -> list:
        """Each layer's (but the head's) backward mode: ``modes`` (names of a budget plan: ``"backprop"``,
        ``"remat"``, ``"rebuild"``) with ``"rebuild"`` meaning ``rebuild``; by default a reversible block is
        rebuilt and a standard layer recomputed (the trainer's default)."""
        if modes is None:
            return default_modes(self.layers[:-1], REBUILDS[rebuild])
        names = [m if isinstance(m, str) else m.plan_name for m in modes]
        return [mode_named(m, rebuild) for m in names]

    def reversible(self, params, states, batch, rebuild: str = "exact", modes=None):
        """Yields ``(i, forward input or None, rebuilt input or None, grads)`` for every layer, top layer
        first, from the reversible trainer's passes with the given ``ReversibleTrainer.rebuild`` mode and
        per-block modes (``modes``: see `block_modes`; a budgeted trainer's). Each mode's forward and
        reverse-and-grad are the trainer's (`revtrain.trainers.modes`); the backprop blocks under the head
        run in the head's program, as in the trainer. One layer's gradients exist at a time (the backprop
        blocks' and the head's together)."""
        layers, n = self.layers, len(self.layers)
        modes = self.block_modes(rebuild, modes)
        top = count_in_head(modes)
        below = n - 1 - top
        x = batch[self.model.input_key]
        saved, seen = {}, []
        for i, layer in enumerate(layers[:below]):
            mode = modes[i]
            if mode.keeps_input:
                saved[i] = x
            seen.append(jax.tree.map(np.asarray, x) if mode.rebuilds else None)
            x = self._forward_program(layer, mode)(params[i], states[i], x, np.int32(i))
        head_layer, programs = layers[-1], self.programs(rebuild)
        if top:
            tops, top_modes = tuple(layers[below:n - 1]), tuple(modes[below:n - 1])
            head = programs.top_head_grads_program(tops, head_layer, top_modes)
            top_grads, grads, dy = head(tuple(params[below:n - 1]), tuple(states[below:n - 1]), params[-1],
                                        states[-1], x, batch, self.skey,
                                        tuple(np.int32(below + k) for k in range(top)), np.int32(n - 1))
            yield n - 1, None, None, grads
            for k in range(top - 1, -1, -1):
                yield below + k, None, None, top_grads[k]
            del top_grads
        else:
            head = programs.per_layer("head_grads", head_layer)
            grads, dy = head(params[-1], states[-1], x, batch, self.skey, np.int32(n - 1))
            yield n - 1, None, None, grads
        y = x
        for i in range(below - 1, -1, -1):
            layer, mode = layers[i], modes[i]
            if mode.rebuilds and mode is not programs.rebuild_mode:  # (every rebuilt block's is the trainer's)
                raise ValueError(f"block {i}: rebuild mode {mode.name} is not the check's {rebuild}")
            program = programs.per_layer("rebuild_grads" if mode.rebuilds else "recompute_grads", layer)
            fn = lambda p, s, start, dy, i, program=program: program(p, s, start, dy, self.skey, i)  # noqa: E731
            if mode.rebuilds:
                y, dy, grads = fn(params[i], states[i], y, dy, np.int32(i))
                item = (i, seen[i], jax.tree.map(np.asarray, y), grads)
                seen[i] = None
            else:
                xs = saved.pop(i)
                _, dy, grads = fn(params[i], states[i], xs, dy, np.int32(i))
                item = (i, None, None, grads)
                y = xs
            self._tell(f"reversible backward ({rebuild} rebuild)", n - i, n)
            yield item

    def backprop(self, params, states, batch, inputs, chunk: int | None):
        """Yields ``(i, grads)`` of ordinary backprop for every layer, top layer first, ``chunk`` layers at a
        time (None: the whole model); one chunk's gradients exist at a time."""
        layers, n = self.layers, len(self.layers)
        chunk = n if not chunk or chunk >= n else chunk
        dy = None
        for start in range(((n - 1) // chunk) * chunk, -1, -chunk):
            stop = min(start + chunk, n)
            idx = list(range(start, stop))
            members = tuple(layers[i] for i in idx)

            def run(ps, ss, x, b, dy, first, members=members, last=stop == n):
                def f(ps, x):
                    for k, layer in enumerate(members):
                        if layer.is_head:
                            loss_sum, stats, _ = layer.loss(ps[k], ss[k], x, b, self._keys(first + k, x), True)
                            total = lax.psum(lax.stop_gradient(stats["weight"]), DATA_AXIS)
                            return loss_sum / total
                        x = layer.apply(ps[k], ss[k], x, self._keys(first + k, x), True)[0]
                    return x

                # Differentiate with respect to the input when it has float leaves (integer leaves, e.g. the
                # side bits of `ExactResidual` blocks, get float0 cotangents); token ids alone have none.
                float_x = any(jnp.issubdtype(a.dtype, jnp.inexact) for a in jax.tree.leaves(x))
                if float_x:
                    out, vjp_fn = jax.vjp(f, per_device(ps), x)
                else:
                    out, vjp_fn = jax.vjp(lambda ps: f(ps, x), per_device(ps))
                cot = jnp.ones_like(out) if last else dy
                res = vjp_fn(cot)
                g, dx = (res[0], res[1]) if float_x else (res[0], None)
                return lax.psum(g, DATA_AXIS), dx

            fn = self._sharded(("backprop", members, stop == n), run, (_R, _R, _D, _D, _D, _R), (_R, _D))
            x_in = jax.tree.map(lambda a: jax.device_put(a, jax.sharding.NamedSharding(self.mesh, _D)), inputs[start])
            g, dy = fn([params[i] for i in idx], [states[i] for i in idx], x_in, batch, dy, np.int32(start))
            self._tell("backprop" if chunk < n else "backprop (whole model)", n - start, n)
            for k in range(len(idx) - 1, -1, -1):
                yield idx[k], g[k]
            del g

    def rows(self, params, states, batch, inputs, chunk: int | None, modes: tuple, block_modes=None) -> list:
        """Per rebuild mode in ``modes``, one row per layer ``(name, reversible, rebuild error or None,
        gradient difference)`` against `backprop`'s gradients (``block_modes``: each block's mode, see
        `block_modes`). The passes walk down the layers together, so only the current layer's (or backprop
        chunk's) gradients exist: the check's memory is the parameters plus one layer's, whatever the
        depth."""
        walks = [self.reversible(params, states, batch, mode, block_modes) for mode in modes]
        out = [[None] * len(self.layers) for _ in modes]
        ref = {}
        reference = self.backprop(params, states, batch, inputs, chunk)
        for i in range(len(self.layers) - 1, -1, -1):
            while i not in ref:
                j, g = next(reference)
                ref[j] = g
            g_ref = ref.pop(i)
            layer = self.layers[i]
            for m, walk in enumerate(walks):
                j, seen, rebuilt, grads = next(walk)
                assert j == i, (j, i)  # both walks go top down, one layer at a time
                rebuild = _rel(seen, rebuilt) if rebuilt is not None else None
                out[m][i] = (layer.name, layer.reversible, rebuild, _rel(g_ref, grads))
                del grads
            del g_ref
        return out


def _with_dtype(cfg, dtype: str):
    """The model built with ``compute_dtype`` forced, or None when the builder has no such parameter."""
    fn = getattr(cfg.model, "__wrapped__", cfg.model)
    try:
        if "compute_dtype" not in inspect.signature(fn).parameters:
            return None
    except (TypeError, ValueError):
        return None
    return dtype


# Above this many layers the default backprop reference is layer-at-a-time (``layers_per_chunk = 1``): one
# whole-model backprop program of a deep model takes XLA minutes to compile (depth 48: over 10 minutes on
# 2 CPU cores), while per-layer programs compile once per distinct layer.
WHOLE_MODEL_MAX_LAYERS = 16


@gin.configurable("check")
def run_check(layers_per_chunk: int | None = None, workdir: str | None = None, step: int | None = None,
              out=None, progress=None) -> int:
    """Runs the check on the parsed gin config; prints a per-layer table and a verdict.

    Progress goes to stderr, a line every few layers of each pass. SIGINT / SIGTERM stop it at once
    (`revtrain.lifecycle.interrupts`): exit 0 before the computation starts, 128 + the signal's number after, with one
    line saying how far it got (there is no verdict then).

    Args:
      layers_per_chunk: compute the backprop reference this many layers at a time (None: the whole model at
        once for models of up to `WHOLE_MODEL_MAX_LAYERS` layers, one layer at a time for deeper ones).
      workdir: check the parameters (and layer state) of this run's checkpoint instead of the model's
        initial ones (``revtrain check --workdir DIR``): trained weights give larger F/G outputs and so show
        the drift a long run will see.
      step: the checkpoint step (default: the newest); only with ``workdir``.
      progress: prints one progress line (default: `revtrain.metrics.log`, stderr).

    Returns:
      0 when every layer is within tolerance, 1 otherwise.

    Raises:
      revtrain.errors.ConfigError, DataError: as for ``revtrain train``.
      CheckpointError: no checkpoint (or no such step) in ``workdir``, or it does not fit the model.
    """
    from revtrain.lifecycle import interrupts
    with interrupts.command_interrupts("check", at_once=True) as guard:
        return _run_check(layers_per_chunk, workdir, step, out or sys.stdout, progress, guard)


def _run_check(layers_per_chunk, workdir, step, out, progress, guard) -> int:
    from revtrain import metrics as metrics_lib
    progress = progress or metrics_lib.log
    jax.config.update("jax_default_matmul_precision", "highest")
    run = run_lib.build(workdir=workdir)
    cfg, mesh = run.cfg, run.mesh
    pc, pi = jax.process_count(), jax.process_index()
    batch = global_batch(next(run.task.train_iterator(cfg.batch_size // pc, cfg.seed, pi, pc)), mesh)
    if workdir is not None:
        params, states, where = _checkpoint_params(run, workdir, step)
    else:
        values, where = _initial_params(run), "initial parameters"
        params, states = [p for p, _ in values], [s for _, s in values]
        del values
    held = params  # as the trainer holds them (a tied leaf in its owner's): the optimizer step's comparison
    # Each layer with its whole params (a tied leaf in both its users': the same placed array, no copy): the
    # check compares per-layer gradients of each use, which the trainers then add up.
    params = [run.model.merge_tied(i, p, params) for i, p in enumerate(params)]
    n = len(run.model.layers)
    if layers_per_chunk is None and n > WHOLE_MODEL_MAX_LAYERS:
        layers_per_chunk = 1
    base_dtype = _model_dtype(cfg)
    mode = _rebuild_mode(run.trainer)
    block_modes, budget = None, None  # a memory budget's plan: each block backprop'd, recomputed or rebuilt
    if run.trainer.memory_budget is not None:
        budget = run.trainer.plan_budget(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch))
        block_modes = budget.names()
    other_mode = next(m for m in ReversibleTrainer.REBUILD_MODES if m != mode)
    results, alternative = {}, None
    done = {"text": None}
    guard.lost_note = lambda: (f"check got as far as {done['text']}" if done["text"] else
                               "check had not finished a layer") + "; no verdict"
    guard.idle = False
    for dtype in (base_dtype, "bfloat16" if base_dtype == "float32" else "float32"):
        if dtype != base_dtype and _with_dtype(cfg, dtype) is None:
            continue
        model = run.model if dtype == base_dtype else cfg.model(seed=cfg.seed, compute_dtype=dtype,
                                                                 **run.task.model_kwargs())

        def tell(text, dtype=dtype):
            done["text"] = f"{dtype} {text}"
            progress(f"check {dtype} {text}")

        checker = _Checker(model, mesh, cfg.seed, progress=tell)
        inputs = checker.forward_inputs(params, states, batch)
        if dtype == base_dtype:
            stream_max = _stream_max(model, inputs)
        # Each precision against backprop in the same precision: what reversibility adds, not what
        # bfloat16 itself costs. The configured dtype also runs the other rebuild mode, for comparison
        # (what switching would give).
        modes = (mode, other_mode) if dtype == base_dtype else (mode,)
        rows = checker.rows(params, states, batch, inputs, layers_per_chunk, modes, block_modes)
        results[dtype] = rows[0]
        if dtype == base_dtype:
            alternative = (other_mode, rows[1])
        del inputs
    reference = ("whole-model backprop" if not layers_per_chunk or layers_per_chunk >= n else
                 "backprop one layer at a time" if layers_per_chunk == 1 else
                 f"backprop {layers_per_chunk} layers at a time")
    print(f"revtrain check: {where}, {n} layers, one batch of {cfg.batch_size} on "
          f"{mesh.size} device(s); reference: {reference}; ReversibleTrainer.rebuild = '{mode}'"
          f"{_plan_text(budget)}; "
          f"update: {run.trainer.update_text()}", file=out)
    note = (_grid_hint(cfg, results[base_dtype], stream_max) or _fused_hint(mode, results[base_dtype], alternative)
            or _noise_hint(results[base_dtype], base_dtype, layers_per_chunk))
    code = _report(results, base_dtype, out, note=note, alternative=alternative)
    return check_optimizer.verdict(run, held, code, out, progress)  # each layer's optimizer step (issue 60)


def _plan_text(budget) -> str:
    """`` (memory budget: 4 backprop, 3 remat, 5 rebuild)`` (reversible blocks) for a budgeted run, else ``""``."""
    if budget is None:
        return ""
    return " (memory budget: " + ", ".join(f"{v} {k}" for k, v in budget.counts().items()) + ")"


def _fused_hint(mode: str, rows, alternative) -> str | None:
    """When the configured rebuild flavour ``mode`` is not exact but the other one checked is, the flavour's
    own line saying why (`modes.BackwardMode.check_note`: the fused rebuild's F and G are compiled inside the
    vjp and round differently from the forward's)."""
    note = REBUILDS[mode].check_note
    if not note or not alternative or not any(rebuild for _, _, rebuild, _ in rows):
        return None
    if any(rebuild for _, _, rebuild, _ in alternative[1]):
        return None
    return note


def _rebuild_mode(trainer) -> str:
    """The rebuild mode the configured run uses: its reversible trainer's, else the gin binding or default
    of ``ReversibleTrainer.rebuild``."""
    mode = trainer.rebuild
    if mode in ReversibleTrainer.REBUILD_MODES:
        return mode
    try:
        mode = gin.query_parameter("ReversibleTrainer.rebuild")
    except ValueError:
        mode = inspect.signature(ReversibleTrainer.__init__).parameters["rebuild"].default
    return mode if mode in ReversibleTrainer.REBUILD_MODES else ReversibleTrainer.REBUILD_MODES[0]


def _noise_hint(rows, dtype: str, layers_per_chunk: int | None) -> str | None:
    """When only gradients are outside tolerance and every rebuild is exact, the difference is how two
    backprop programs round, not reversibility: a line saying how to see that (layer-at-a-time backprop,
    which the reversible trainer matches bit for bit when nothing is wrong)."""
    _, tol_grad = TOLERANCE.get(dtype, TOLERANCE["float32"])
    exact = all(not rebuild for _, _, rebuild, _ in rows)
    over = any(g is not None and not g <= tol_grad for _, _, _, g in rows)
    if not (exact and over) or layers_per_chunk == 1:
        return None
    return ("note: every rebuild is exact, so the gradient difference is how whole-model backprop rounds "
            "differently from per-layer programs; --gin check.layers_per_chunk=1 compares with backprop "
            "one layer at a time (0.0 expected)")


def _stream_max(model, inputs) -> float:
    """Largest magnitude any reversible layer's input or output stream reaches in the forward pass."""
    top = 0.0
    for i, layer in enumerate(model.layers[:-1]):
        if layer.reversible:
            for leaf in jax.tree.leaves((inputs[i], inputs[i + 1])):
                if np.issubdtype(np.asarray(leaf).dtype, np.floating):
                    top = max(top, float(np.abs(np.asarray(leaf)).max()))
    return top


def _grid_hint(cfg, rows, stream_max: float) -> str | None:
    """When a rebuild was not exact and the streams left the fixed-point grid's exact range
    (``|x| < 2**(24 - grid_bits)`` in float32), a line saying which ``grid_bits`` would keep it exact."""
    bits = _model_param(cfg, "grid_bits", None)
    if not isinstance(bits, int) or stream_max < 2.0 ** (24 - bits):
        return None
    if not any(rebuild for _, _, rebuild, _ in rows):
        return None
    fits = 23 - int(math.floor(math.log2(stream_max)))
    name = cfg.model.__name__
    return (f"note: the residual streams reach {stream_max:.1f} in magnitude, beyond the exact range "
            f"{2 ** (24 - bits)} of {name}.grid_bits = {bits}, so the rebuild rounds; {name}.grid_bits <= {fits} "
            f"(range {2 ** (24 - fits)}) keeps it exact")


def _initial_params(run) -> list:
    """``(params, state)`` of every layer at initialisation, placed replicated one layer at a time (a lazy
    layer's initial values exist as numpy only while it is placed)."""
    out = []
    for i in range(len(run.model.layers)):
        values = run.model.init_layer(i)
        out.append(put_replicated(values, run.mesh))
        del values
    return out


def _checkpoint_params(run, workdir: str, step: int | None):
    """(params, layer states, description) of a checkpoint of ``workdir``: the weights and layer state alone
    (the optimizer state is not read), placed replicated."""
    from revtrain import checkpoint as ckpt_lib
    checkpointer = ckpt_lib.Checkpointer(workdir, read_only=True)
    try:
        ts, chosen = checkpointer.restore_newest(run.trainer.abstract_state(), step,
                                                 optimizer_state=False,  # skips a damaged newest one
                                                 accept=run_lib.same_model(run, workdir))
    finally:
        checkpointer.close()
    # Offloaded or sharded runs restore into host memory or shards: the check's programs take replicated
    # device arrays, placed one layer at a time.
    params, states = [], []
    for i in range(len(ts.params)):
        params.append(put_replicated(ts.params[i], run.mesh))
        states.append(put_replicated(ts.layer_state[i], run.mesh))
        ts.params[i] = ts.layer_state[i] = None  # the restored copy goes as its replica is made
    return params, states, f"checkpoint at step {chosen} of {workdir}"


def _model_param(cfg, name: str, default):
    """The model builder's parameter ``name``: its gin binding, else its default, else ``default``."""
    try:
        return gin.query_parameter(f"{cfg.model.__name__}.{name}")
    except (ValueError, AttributeError):
        fn = getattr(cfg.model, "__wrapped__", cfg.model)
        try:
            value = inspect.signature(fn).parameters[name].default
        except (KeyError, TypeError, ValueError):
            return default
        return default if value is inspect.Parameter.empty else value


def _model_dtype(cfg) -> str:
    dtype = _model_param(cfg, "compute_dtype", "float32")
    return dtype if isinstance(dtype, str) else "float32"


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.1e}"


def _worst(rows, dtype: str):
    """(ratio to tolerance, layer name, description) of the row furthest from ``dtype``'s tolerance."""
    tol_rebuild, tol_grad = TOLERANCE.get(dtype, TOLERANCE["float32"])
    worst = (-1.0, None, None)  # the first measured value wins even when every difference is 0
    for name, _, rebuild, gdiff in rows:
        for value, tol, what in ((rebuild, tol_rebuild, "rebuild error"), (gdiff, tol_grad, "gradient difference")):
            if value is not None and (not np.isfinite(value) or value / tol > worst[0]):
                worst = (value / tol if np.isfinite(value) else float("inf"), name, f"{what} {value:.1e}")
    return worst


def _worst_text(ratio: float, name, what) -> str:
    if ratio == 0.0:
        return "every layer bit-identical to backprop"
    return f"worst layer {name} ({what})"


def _report(results: dict, base: str, out, note: str | None = None, alternative=None) -> int:
    """Prints the table, ``note`` (if any) and the verdict (on the configured dtype ``base`` and rebuild
    mode; the other dtype's columns and, last, the other rebuild mode's, ``alternative = (mode, rows)`` in
    ``base``, are for comparison: what switching would do). Returns the exit status."""
    rows = results[base]
    other = next((d for d in results if d != base), None)
    head = f"{'layer':<14} {'kind':<10} {'rebuild ' + base:>17} {'grad diff ' + base:>19}"
    if other:
        head += f" {'rebuild ' + other:>17} {'grad diff ' + other:>19}"
    if alternative:
        alt = alternative[0]
        head += f" {'rebuild ' + base + ' ' + alt:>23} {'grad diff ' + base + ' ' + alt:>25}"
    print(head, file=out)
    for k, (name, reversible, rebuild, gdiff) in enumerate(rows):
        line = f"{name:<14} {'reversible' if reversible else 'standard':<10} {_fmt(rebuild):>17} {_fmt(gdiff):>19}"
        if other:
            line += f" {_fmt(results[other][k][2]):>17} {_fmt(results[other][k][3]):>19}"
        if alternative:
            line += f" {_fmt(alternative[1][k][2]):>23} {_fmt(alternative[1][k][3]):>25}"
        print(line, file=out)
    if other:
        ratio, name, what = _worst(results[other], other)
        tol_rebuild, tol_grad = TOLERANCE[other]
        print(f"(for comparison: compute dtype {other} would be {'within' if ratio <= 1 else 'OUTSIDE'} its "
              f"tolerance {tol_rebuild:.0e} / {tol_grad:.0e}; {_worst_text(ratio, name, what)})", file=out)
    if alternative:
        ratio, name, what = _worst(alternative[1], base)
        tol_rebuild, tol_grad = TOLERANCE.get(base, TOLERANCE["float32"])
        print(f"(for comparison: ReversibleTrainer.rebuild = '{alternative[0]}' would be "
              f"{'within' if ratio <= 1 else 'OUTSIDE'} the tolerance; {_worst_text(ratio, name, what)})", file=out)
    if note:
        print(note, file=out)
    ratio, name, what = _worst(rows, base)
    tol_rebuild, tol_grad = TOLERANCE.get(base, TOLERANCE["float32"])
    ok = ratio <= 1.0
    print(f"{'PASS' if ok else 'FAIL'}: compute dtype {base}, tolerance {tol_rebuild:.0e} (rebuild) / "
          f"{tol_grad:.0e} (gradient); {_worst_text(ratio, name, what)}", file=out)
    return 0 if ok else 1
