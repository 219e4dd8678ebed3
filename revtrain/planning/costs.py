"""What the trainer's programs cost: compiled on shapes, once, and read by both planners.

Both planners (`revtrain.planning.memory`, `revtrain.planning.budget`) ask the trainer's per-layer programs
(`revtrain.trainers.programs.LayerPrograms`, ``trainer.programs``) for the programs a step runs, compile
them on the abstract arguments the step passes (`StepCosts`: the global batch, the state's shardings and memory
kinds), and read ``memory_analysis()`` (temporaries, results) and ``cost_analysis()`` (FLOPs); the budget's
``'time'`` objective runs each on zeros and times it (`time_call`). The compiled programs are the run's own:
its first step finds them compiled, and its first evaluation its evaluation programs (`eval_temporaries`). A
trainer choice without a trainer (the memory plan's alternatives) gets the same programs from
`LayerPrograms.on_mesh` on one device (`PlanPrograms`); nothing here declares a program of its own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import time
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from revtrain.optstate import tree_nbytes
from revtrain.placement import DATA_AXIS
from revtrain.planning.shapes import is_float, mesh1, shape_key
from revtrain.trainers.common import XLA_OPTIONS, TrainerBase
from revtrain.trainers.modes import BACKPROP, CHECKPOINT, count_in_head, default_modes
from revtrain.trainers.programs import LayerPrograms


@dataclasses.dataclass
class Cost:
    """What one program call adds to the live device bytes (``extra``, the meter's rule), its FLOPs and
    (``objective='time'``) its measured seconds per block."""

    extra: int
    flops: float
    seconds: float = 0.0
    temp: int = 0  # the program's own temporaries (``temp_size_in_bytes``): the memory plan's term


# A program compiled only to read its bytes and FLOPs (`StepCosts.bytes_only`: a budget every plan exceeds):
# XLA's LLVM backend at -O0. Buffer assignment and the cost analysis are decided on the optimised HLO before
# the backend runs, so ``memory_analysis()`` and ``cost_analysis()`` read the same as at the default level (on
# the default model each of the 11 programs a refusal compiles read the same bytes) for about 30-40% less
# compile time; the executable is never run, timed or kept.
BYTES_ONLY_OPTIONS = {**XLA_OPTIONS, "xla_backend_optimization_level": 0}

TIMED_CALLS = 1  # timed calls of each program after one warm-up call (their minimum is taken)


def _zeros_like_args(compiled, args):
    """Zero-filled arguments for ``compiled`` (placed as its input shardings say) shaped like ``args``."""
    shardings = compiled.input_shardings[0]
    return jax.tree.map(lambda a, s: jax.device_put(np.zeros(np.shape(a), a.dtype), s), tuple(args), tuple(shardings))


def time_call(compiled, args, calls: int = TIMED_CALLS) -> float:
    """Seconds of one call of ``compiled`` (a compiled program) on zero-filled arguments shaped like
    ``args`` (abstract): the least of ``calls`` timed calls after a warm-up call. Fresh arguments each call
    (a program may donate them); the clock covers the call and waiting for its results only."""
    best = float("inf")
    for c in range(calls + 1):
        inputs = _zeros_like_args(compiled, args)
        jax.block_until_ready(inputs)
        start = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        if c:
            best = min(best, time.perf_counter() - start)
    return best




def device_bytes(tree) -> int:
    """Bytes of the leaves of an abstract tree not placed in host memory."""
    return sum(tree_nbytes(x) for x in jax.tree.leaves(tree)
               if getattr(getattr(x, "sharding", None), "memory_kind", None) not in ("pinned_host", "unpinned_host"))


def stacked(tree, n: int):
    """An abstract tree stacked ``n`` times along a new leading layer axis, each leaf where its layer's lives:
    its memory kind kept (a stack of offloaded weights stays in host memory, as `Residency.place_stacked`
    puts it) and its spec with the layer axis unsplit. (A stack without memory kinds made the scanned
    reverse program of offloaded weights mix a device stack with its host slices.)"""
    def one(x):
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding):  # (a replicated leaf stays ``P()``: the sharding the run's stack has)
            spec = P(None, *sharding.spec) if any(a is not None for a in sharding.spec) else P()
            sharding = NamedSharding(sharding.mesh, spec, memory_kind=sharding.memory_kind)
        else:
            sharding = None
        return jax.ShapeDtypeStruct((n, *x.shape), x.dtype, sharding=sharding)
    return jax.tree.map(one, tree)


def program_state(trainer, held):
    """The abstract state as the trainer's programs take it (``held``: its `abstract_state`): a streamed tier's
    layers as device arrays (its programs compute on the layer the engine fetched), and a tied parameter's
    user (the head) with its tied leaves in its tree, as the head's program computes on them (the deferred
    update passes them in beside its own; here they count as its own, a bound)."""
    params, opt = list(held.params), list(held.opt_state)
    rep = NamedSharding(trainer.mesh, P())
    place = lambda tree, like: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=like), tree)
    shapes = trainer.model.param_shapes()
    users = {tie.user for tie in trainer.model.ties}
    on_device = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding.with_memory_kind("device")), tree)
    where = trainer.residency.state_memory  # (the tier's: "device", "host", or None: its own store's refs)
    for i, layer in enumerate(trainer.model.layers):
        if where == "host":  # the host store's: fetched to the device
            params[i], opt[i] = on_device(params[i]), on_device(opt[i])
        if where is None or i in users:
            like = rep if where is None else jax.tree.leaves(params[i])[0].sharding
            tree = layer.param_shapes if i in users else shapes[i]  # (a user's: its tied leaves in it)
            params[i], opt[i] = place(tree, like), place(jax.eval_shape(trainer.tx.init, tree), like)
    return types.SimpleNamespace(params=params, opt_state=opt, layer_state=list(held.layer_state))


def compile_program(program, args, options: dict | None = None):
    """``program`` (a jitted function) lowered on ``args`` (abstract) and compiled: JAX keeps the executable, so
    the run's own call of ``program`` on arrays of these shapes and shardings compiles nothing again.
    ``options``: XLA compile options instead of the program's own (`BYTES_ONLY_OPTIONS`)."""
    return _compiled_quietly(lower_program(program, args), options)


def lower_program(program, args):
    """``program`` lowered on ``args`` (abstract): traced and turned into XLA's module, not compiled yet."""
    with warnings.catch_warnings():  # (a donation XLA cannot use on these shapes: said once, at run time)
        warnings.simplefilter("ignore")
        return program.lower(*args)


class Compiles:
    """Lowered programs compiled on every core as they are handed in (`submit`), while the caller traces and
    lowers the next: XLA compiles without holding the interpreter, so tracing overlaps the compiles of the
    programs before (the budget planner's table: about 2.6 s of tracing and lowering beside 9 s of compiles
    on 2 cores, docs/budget.md). Used as a context: leaving it waits for every compile; each future's result is
    the compiled program. Python's warnings are off while it is open (process-wide: filters are not per thread;
    a donation XLA cannot use on these shapes is said once, at run time). ``options``: as `compile_program`'s."""

    def __init__(self, options: dict | None = None):
        self.options = options
        self._pool = None
        self._warnings = warnings.catch_warnings()

    def __enter__(self) -> "Compiles":
        self._warnings.__enter__()
        warnings.simplefilter("ignore")
        self._pool = concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1,
                                                           thread_name_prefix="revtrain-plan-compile")
        return self

    def submit(self, lowered) -> concurrent.futures.Future:
        """Starts compiling ``lowered`` (a lowered program); its future's result is the compiled program."""
        options = self.options
        return self._pool.submit(lambda: lowered.compile(compiler_options=options) if options else lowered.compile())

    def __exit__(self, *exc) -> None:
        try:
            self._pool.shutdown(wait=True)
        finally:
            self._warnings.__exit__(*exc)


def _compiled_quietly(lowered, options: dict | None = None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lowered.compile(compiler_options=options) if options else lowered.compile()


class StepCosts:
    """The trainer's own programs (``trainer.programs``, `LayerPrograms`) compiled on the abstract arguments a
    step passes them (``batch_spec``: the global (micro)batch's shapes), and what each costs (`Cost`), cached
    per distinct program. Made once per trainer and batch shape (`step_costs`): the memory plan, the budget
    planner and the run's first step share its compiles. ``timed``: a program read from now on is also run on
    zeros and timed (`time_call`), once; one compiled untimed is kept and timed then without a second
    compile."""

    def __init__(self, trainer, batch_spec: dict):
        self.trainer = t = trainer
        self.timed = False  # `read` times each program too (the budget planner's ``'time'`` objective)
        self.bytes_only = False  # programs compiled for their readings alone (`reading_bytes`)
        self.mesh = t.mesh
        data = NamedSharding(self.mesh, P(DATA_AXIS))
        self.batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=data) for k, v in batch_spec.items()}
        self.state = t.abstract_state()  # the state as it is held (the disk tier's: layer files)
        self.abstract = program_state(t, self.state)  # ... as the programs take it
        # The step's key as the step passes it: an uncommitted array (`common.step_key`), no sharding of its own.
        self.skey = jax.ShapeDtypeStruct((2,), jnp.uint32)
        self.ctx = self.skey  # the key context the step passes its programs (the deferred update's: below)
        self.cache: dict = {}
        self.growth: dict = {}  # (backward kind, layer) -> a run's bytes per block more (`run_growth`)
        self.lengths: dict = {}  # (block, backward kind) -> the table's length of its run's scans (`table_length`)
        self.compiled: dict = {}  # programs compiled untimed, kept to be timed without a second compile
        self._ready: dict = {}  # programs compiled ahead (`prepare`), not read yet
        self._asked = None  # while `prepare` collects: the programs asked for, compiling (futures)
        self._compiles = None  # ... and the `Compiles` compiling them
        # ("fwd" | "bwd", block index, program kind) -> the cached `Cost`; ("run", block index, ...) -> a run's
        # pair (`run_costs`); ("growth", block index, kind) -> `run_growth`'s
        self.blocks: dict = {}
        self.keeps_on_host = t.residency.keeps_on_host  # kept inputs wait in host memory (the host tier)
        self.own_store = t.residency.state_memory is None  # the state in the tier's own store (its files)
        self.streamed = t.residency.streamed
        layers = t.model.layers
        self.moved = [tree_nbytes((self.abstract.params[i], self.abstract.opt_state[i])) for i in range(len(layers))]
        # A streamed tier: beside a program's own layer, one layer being written and one fetched ahead (the
        # disk tier's read only once the program before has run: with its temporaries or in their place;
        # the host store's during the program, `revtrain.streaming`).
        self.in_flight = max(self.moved) if self.streamed else 0
        # Each layer's input shapes (global, split over "data").
        x = self.batch[t.model.input_key]
        self.inputs = []
        for i, layer in enumerate(layers[:-1]):
            self.inputs.append(x)
            out = t.programs.per_layer("forward_std", layer).eval_shape(
                self.abstract.params[i], self.abstract.layer_state[i], x, self.skey, np.int32(i))[0]
            x = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=data), out)
        self.inputs.append(x)
        # The deferred update (`revtrain.trainers.deferred.DeferredUpdate`): the run's backward and head are its
        # accumulating programs, each adding a layer's gradient to its buffer (shaped and placed like the
        # weights, donated and returned), their key a microbatch's context with microbatches. Read here in
        # place of the fused update's (the run compiles these; its update passes are not compiled here).
        self.deferred = t.deferred_update
        if self.deferred is not None:
            shapes, users = t.model.param_shapes(), {tie.user for tie in t.model.ties}
            place = lambda tree, like: jax.tree.map(  # noqa: E731
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=like), tree)
            # (a tied user's weights as held, without its tied leaves: the head's program borrows them)
            self.owned = [place(shapes[i], jax.tree.leaves(p)[0].sharding) if i in users else p
                          for i, p in enumerate(self.abstract.params)]
            # (`common.microbatch_where`, replicated as `DeferredUpdate._where` places it; every program of the
            # step takes this context, its forwards too)
            where = jax.ShapeDtypeStruct((2,), jnp.int32, sharding=NamedSharding(self.mesh, P()))
            self.ctx = self.skey if t.microbatches == 1 else (self.skey, where)

    def _acc_moved(self, i: int) -> int:
        """Bytes a streamed tier brings in for layer ``i``'s accumulating program: its weights and buffer."""
        return 2 * tree_nbytes(self.owned[i])

    def _read(self, key, program, args, moved: int, blocks: int = 1, timeable: bool = True) -> Cost:
        """The cost of one call of ``program`` on ``args`` (abstract); ``blocks``: the blocks one call runs
        (a scanned run's), its seconds given per block; ``timeable=False``: not timed by this read (its bytes
        alone; a later timed read times it, compiled once)."""
        timed = self.timed and timeable
        if self._asked is not None:  # (`prepare` collects: nothing is read yet)
            if key not in self.cache and key not in self._ready and key not in self._asked:
                self._asked[key] = self._compiles.submit(lower_program(program, args))
            return Cost(0, 0.0)
        if key in self.cache:
            if timed and not self.cache[key].seconds:  # compiled untimed (the refusal's check), timed when asked
                compiled, args, blocks = self.compiled.pop(key, None) or (compile_program(program, args), args, blocks)
                self.cache[key].seconds = time_call(compiled, args) / blocks
        else:
            compiled = self._ready.pop(key, None)
            if compiled is None:
                compiled = compile_program(program, args, BYTES_ONLY_OPTIONS if self.bytes_only else None)
            timed = timed and not self.bytes_only
            seconds = time_call(compiled, args) / blocks if timed else 0.0
            if not timed and not self.bytes_only:  # (kept: read for its bytes, it may be timed later as a plan's)
                self.compiled[key] = (compiled, args, blocks)
            mem = compiled.memory_analysis()
            extra = int(mem.temp_size_in_bytes) + max(0, int(mem.output_size_in_bytes) - int(mem.alias_size_in_bytes))
            try:
                cost = compiled.cost_analysis()
                cost = cost[0] if isinstance(cost, (list, tuple)) else cost
                flops = float(cost.get("flops", 0.0))
            except Exception:  # noqa: BLE001 (a backend without cost analysis)
                flops = 0.0
            if self.own_store:  # its layer read from its file, the one before being written, the next read ahead
                extra = moved + self.in_flight + max(extra, self.in_flight)
            elif self.streamed:  # its layer, the one before being written back and those fetched ahead, beside it
                extra += moved + (1 + self.trainer.residency.store.depth) * self.in_flight
            self.cache[key] = Cost(extra, flops, seconds, int(mem.temp_size_in_bytes))
        return self.cache[key]

    def prepare(self, *calls) -> None:
        """Compiles every program the ``calls`` (functions of no argument that read costs here: `forward`,
        `head`, a plan's walk) will read, all at once on every core, each as soon as it is lowered (`Compiles`:
        the next is traced meanwhile), so that the calls themselves then only read compiled programs. The
        calls run twice: once to collect their programs (nothing read, the costs they see are zeros), and once
        more by the caller. Results are those of reading one program at a time."""
        blocks = set(self.blocks)
        self._asked = {}
        try:
            with Compiles(BYTES_ONLY_OPTIONS if self.bytes_only else None) as self._compiles:
                for call in calls:
                    call()
        finally:
            asked, self._asked, self._compiles = self._asked, None, None
            for key in set(self.blocks) - blocks:  # (the zeros seen while collecting)
                del self.blocks[key]
        self._ready.update((key, future.result()) for key, future in asked.items())

    @contextlib.contextmanager
    def reading_bytes(self, on: bool = True):
        """Within it (``on``), programs read for the first time are compiled for their bytes and FLOPs alone
        (`BYTES_ONLY_OPTIONS`, faster), not timed and not kept: for a budget below what every plan needs,
        whose programs never run. A cost read so stays cached (the same bytes and FLOPs); a later timed read
        compiles its program again as the run compiles it."""
        if not on:
            yield
            return
        was, self.bytes_only = self.bytes_only, True
        ready = set(self._ready)
        try:
            yield
        finally:
            self.bytes_only = was
            for key in set(self._ready) - ready:  # (compiled ahead in this mode and not read: not the run's)
                del self._ready[key]

    RUN_KINDS = {"reverse": ("forward_run", "reverse_run"), "recompute": ("remat_forward_run", "remat_backward_run")}
    RUN_LENGTH = 2  # the least length a run's scans are compiled and timed at for the table (`table_length`)

    def table_length(self, i: int, backward_kind: str) -> int:
        """The length the table of plans compiles and times the scans of block ``i``'s run in the mode whose
        per-layer backward is ``backward_kind`` at (`lengths`, set by the budget planner: the run's length in
        the plans most often compiled as they run; `RUN_LENGTH` where none is set)."""
        return self.lengths.get((i, backward_kind), self.RUN_LENGTH)

    def run_costs(self, i: int, backward_kind: str, n: int, timed: bool = True) -> tuple:
        """The costs ``(forward, backward)`` of one call of the scans of a run of ``n`` blocks like ``i`` in
        the mode whose per-layer backward is ``backward_kind`` (seconds per block); ``timed=False``: read for
        their bytes only (not timed by this read)."""
        fast = ("run", i, backward_kind, n, timed)  # (per block index, as `forward`: no hash of the layer's graph)
        if fast not in self.blocks:
            self.blocks[fast] = self._run_costs(i, backward_kind, n, timed)
        return self.blocks[fast]

    def _run_costs(self, i: int, backward_kind: str, n: int, timed: bool) -> tuple:
        t, layer, a = self.trainer, self.trainer.model.layers[i], self.abstract
        stack = lambda tree: stacked(tree, n)  # noqa: E731
        params, opt, states = stack(a.params[i]), stack(a.opt_state[i]), stack(a.layer_state[i])
        fwd, bwd = self.RUN_KINDS[backward_kind]
        f = self._read(("fwd_run", fwd, layer, n), t.programs.run(fwd, layer, n),
                       (params, states, self.inputs[i], self.ctx, np.int32(i)), 0, n, timed)
        start = stack(self.inputs[i]) if bwd == "remat_backward_run" else self.inputs[i + 1]
        if self.deferred is not None:  # (its accumulating scan, `DeferredUpdate.run`: a rebuilt run's only)
            acc = stack(self.owned[i])
            b = self._read(("bwd_run", "reverse_run_acc", layer, n), self.deferred.run(layer, n),
                           (stack(self.owned[i]), acc, states, start, self.inputs[i + 1], self.ctx, np.int32(i)),
                           0, n, timed)
            return f, b
        b = self._read(("bwd_run", bwd, layer, n), t.programs.run(bwd, layer, n),
                       (params, opt, states, start, self.inputs[i + 1], self.skey, np.int32(i)), 0, n, timed)
        return f, b

    def has_block(self, i: int, forward_kind: str, backward_kind: str) -> bool:
        """Whether block ``i``'s own forward and backward programs (`forward`, `backward`) were read already."""
        layer = self.trainer.model.layers[i]
        if self.deferred is not None:
            backward_kind = {"reverse": "reverse_acc", "recompute": "recompute_acc"}[backward_kind]
        return ("fwd", forward_kind, layer) in self.cache and ("bwd", backward_kind, layer) in self.cache

    def has_run(self, i: int, backward_kind: str, n: int) -> bool:
        """Whether the scans of a run of ``n`` blocks like ``i`` (`run_costs`) were read already (compiled)."""
        layer = self.trainer.model.layers[i]
        fwd, bwd = self.RUN_KINDS[backward_kind]
        bwd = "reverse_run_acc" if self.deferred is not None else bwd
        return ("fwd_run", fwd, layer, n) in self.cache and ("bwd_run", bwd, layer, n) in self.cache

    def run_extra(self, i: int, backward_kind: str, count: int) -> tuple:
        """``(forward, backward)`` bytes one call of a run of ``count`` blocks like ``i`` adds (`Cost.extra`):
        its scans compiled at `table_length` blocks, grown by `run_growth` per block more (or less: ``count``
        1 stands for a block alone)."""
        length = self.table_length(i, backward_kind)
        f, b = self.run_costs(i, backward_kind, length)
        fg, bg = self.run_growth(i, backward_kind)
        more = count - length
        return max(0, f.extra + more * fg), max(0, b.extra + more * bg)

    def run_growth(self, i: int, backward_kind: str) -> tuple:
        """``(forward, backward)`` bytes a scan of blocks like ``i`` adds per block more: what its results grow
        by, from their shapes at `RUN_LENGTH` and one block more (traced, nothing compiled): the stacked
        states and flags it returns, a remat run's kept inputs; a backward scan's updated weights and optimizer
        state are its donated stacks' (XLA writes them in place), so they are not counted. Its temporaries do
        not grow (one block's body at a time: compiled at 2 and 3 blocks, the default model's scans' temporaries
        were equal)."""
        fast = ("growth", i, backward_kind)  # (per block index: no hash of the layer's graph)
        if fast in self.blocks:
            return self.blocks[fast]
        layer = self.trainer.model.layers[i]
        key = (backward_kind, layer)
        if key not in self.growth:
            t, a, n = self.trainer, self.abstract, self.RUN_LENGTH
            fwd, bwd = self.RUN_KINDS[backward_kind]
            results = []
            for count in (n, n + 1):
                stack = lambda tree: stacked(tree, count)  # noqa: E731
                params, opt, states = stack(a.params[i]), stack(a.opt_state[i]), stack(a.layer_state[i])
                start = stack(self.inputs[i]) if bwd == "remat_backward_run" else self.inputs[i + 1]
                f = t.programs.run(fwd, layer, count).eval_shape(params, states, self.inputs[i], self.skey, np.int32(i))
                if self.deferred is not None:  # (the buffer stack is donated and written in place)
                    acc = stack(self.owned[i])
                    b = self.deferred.run(layer, count).eval_shape(acc, acc, states, start, self.inputs[i + 1],
                                                                   self.ctx, np.int32(i))
                    results.append((tree_nbytes(f), tree_nbytes(b) - tree_nbytes(acc)))
                    continue
                b = t.programs.run(bwd, layer, count).eval_shape(params, opt, states, start, self.inputs[i + 1],
                                                                self.skey, np.int32(i))
                results.append((tree_nbytes(f), tree_nbytes(b) - tree_nbytes((params, opt))))
            (f2, b2), (f3, b3) = results
            self.growth[key] = (max(0, f3 - f2), max(0, b3 - b2))
        self.blocks[fast] = self.growth[key]
        return self.growth[key]

    def forward(self, i: int, kind: str) -> Cost:
        """The cost of block ``i``'s own forward program ``kind`` (a `LayerPrograms` per-layer kind)."""
        if ("fwd", i, kind) not in self.blocks:  # (per block index: a plan's walk looks each up without hashing
            t, layer = self.trainer, self.trainer.model.layers[i]  # the layer's module graph)
            a = self.abstract
            args = (a.params[i], a.layer_state[i], self.inputs[i], self.ctx, np.int32(i))
            self.blocks[("fwd", i, kind)] = self._read(("fwd", kind, layer), t.programs.per_layer(kind, layer), args,
                                                       self.moved[i])
        return self.blocks[("fwd", i, kind)]

    def backward(self, i: int, kind: str) -> Cost:
        """The cost of block ``i``'s own backward program ``kind`` (``"reverse"`` from its output, ``"recompute"``
        from its kept input), its update with it."""
        if ("bwd", i, kind) not in self.blocks:
            t, layer = self.trainer, self.trainer.model.layers[i]
            a = self.abstract
            start = self.inputs[i + 1] if kind == "reverse" else self.inputs[i]
            if self.deferred is not None:  # (its accumulating program: the run's)
                acc_kind = {"reverse": "reverse_acc", "recompute": "recompute_acc"}[kind]
                args = (self.owned[i], self.owned[i], a.layer_state[i], start, self.inputs[i + 1], self.ctx,
                        np.int32(i))
                self.blocks[("bwd", i, kind)] = self._read(("bwd", acc_kind, layer),
                                                           self.deferred.per_layer(acc_kind, layer), args,
                                                           self._acc_moved(i))
                return self.blocks[("bwd", i, kind)]
            args = (a.params[i], a.opt_state[i], a.layer_state[i], start, self.inputs[i + 1], self.skey, np.int32(i))
            self.blocks[("bwd", i, kind)] = self._read(("bwd", kind, layer), t.programs.per_layer(kind, layer), args,
                                                       self.moved[i])
        return self.blocks[("bwd", i, kind)]

    def head(self, k: int, h: int = 0, top=BACKPROP) -> Cost:
        """The head's program with the ``k`` blocks under it inside (in mode ``top``: backprop, or another mode
        of `walk.StepKind.TOP`) and the ``h`` under those (checkpoint)."""
        t, layers, a = self.trainer, self.trainer.model.layers, self.abstract
        n = len(layers) - 1
        if self.deferred is not None:
            return self._acc_head(k, h, top)
        if k + h == 0:
            args = (a.params[n], a.opt_state[n], a.layer_state[n], self.inputs[n], self.batch, self.skey, np.int32(n))
            return self._read(("head", 0, layers[n]), t.programs.per_layer("head", layers[n]), args, self.moved[n])
        # The groups as the trainer's layout gives them (`ReversibleTrainer.layout`: with the scanned executor
        # h >= 2 identical checkpoint blocks are one stacked run, else every block is a group of its own).
        modes = default_modes(layers[:-1], t.rebuild_mode)
        modes[n - k - h:] = [CHECKPOINT] * h + [top] * k
        groups = [(i, c) for i, c in t.layout(modes) if n - k - h <= i < n]
        stack = lambda tree, c: tree if c == 1 else stacked(tree, c)  # noqa: E731
        args = (tuple(stack(a.params[i], c) for i, c in groups), tuple(stack(a.opt_state[i], c) for i, c in groups),
                tuple(stack(a.layer_state[i], c) for i, c in groups), a.params[n], a.opt_state[n], a.layer_state[n],
                self.inputs[n - k - h], self.batch, self.skey, tuple(np.int32(i) for i, _ in groups), np.int32(n))
        program = t.programs.top_head(tuple(layers[i] for i, _ in groups), layers[n],
                                 tuple(CHECKPOINT if i < n - k else top for i, _ in groups),
                                 tuple(c for _, c in groups))
        key = ("head", k, h, layers[n], layers[n - 1]) + (() if top is BACKPROP else (top.name,))
        return self._read(key, program, args,
                          sum(self.moved[i] for i in range(n - k - h, n)) + self.moved[n])

    def _acc_head(self, k: int, h: int, top) -> Cost:
        """`head` with the deferred update: its accumulating head program (`DeferredUpdate.per_layer`
        ``"head_acc"``, the tied leaves borrowed from their owners and their other use's buffer beside), or with
        blocks inside it `DeferredUpdate.top_head` (one block a group: the deferred update scans no
        checkpoint run)."""
        t, layers, a, acc = self.trainer, self.trainer.model.layers, self.abstract, self.deferred
        n, w = len(layers) - 1, self.owned
        if k + h == 0:
            owners = {tie.owner: w[tie.owner] for tie in t.model.ties}
            # (whole on every device, as the step borrows them: an owner's split leaf replicated, `_borrowed`)
            tied = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(self.mesh, P()))
                         if any(d is not None for d in getattr(x.sharding, "spec", ())) else x
                         for x in t.model.tied_leaves(n, owners))
            args = (w[n], w[n], a.layer_state[n], self.inputs[n], self.batch, self.ctx, np.int32(n), tied, tied)
            return self._read(("head_acc", 0, layers[n]), acc.per_layer("head_acc", layers[n]), args,
                              self._acc_moved(n) + 2 * tree_nbytes(tied))
        inside = range(n - k - h, n)
        modes = tuple(CHECKPOINT if i < n - k else top for i in inside)
        args = (tuple(w[i] for i in inside), tuple(w[i] for i in inside), tuple(a.layer_state[i] for i in inside),
                w[n], w[n], a.layer_state[n], self.inputs[n - k - h], self.batch, self.ctx,
                tuple(np.int32(i) for i in inside), np.int32(n))
        program = acc.top_head(tuple(layers[i] for i in inside), layers[n], modes)
        key = ("head_acc", k, h, layers[n], layers[n - 1]) + (() if top is BACKPROP else (top.name,))
        return self._read(key, program, args, sum(self._acc_moved(i) for i in range(n - k - h, n + 1)))



def step_costs(trainer, batch_spec: dict) -> StepCosts:
    """The `StepCosts` of ``trainer`` on batches shaped like ``batch_spec`` (the global (micro)batch), made once:
    kept with the programs it compiled (``trainer.programs.readings``), so the memory plan, the budget planner
    and a later plan of the same trainer read each program once."""
    key = tuple(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in batch_spec.items()))
    readings = trainer.programs.readings
    if key not in readings:
        readings[key] = StepCosts(trainer, batch_spec)
    return readings[key]


def step_temporaries(trainer, batch_spec: dict) -> list:
    """The temporaries (bytes) of every program one step of ``trainer`` runs, in its layout and block modes
    (``trainer.groups``, ``trainer.block_modes``): each group's forward and backward (a stacked run's scans at
    its length) and the head's program with the blocks inside it. The programs compiled are the ones the
    step calls (`StepCosts`), compiled all at once (`StepCosts.prepare`)."""
    costs = step_costs(trainer, batch_spec)
    modes = list(trainer.block_modes)
    n, inside = len(modes), count_in_head(modes)

    def walk() -> list:
        temps = []
        for start, count in trainer.layout(modes):
            if start >= n - inside:
                break
            forward_kind, backward_kind, _ = modes[start].program_kinds
            if count > 1:
                f, b = costs.run_costs(start, backward_kind, count)
            else:
                f, b = costs.forward(start, forward_kind), costs.backward(start, backward_kind)
            temps += [f.temp, b.temp]
        checkpointed = sum(1 for m in modes[n - inside:] if m is CHECKPOINT)
        top = modes[-1] if inside > checkpointed else BACKPROP
        temps.append(costs.head(inside - checkpointed, checkpointed, top).temp)
        return temps

    costs.prepare(walk)
    return walk()


def eval_temporaries(trainer, eval_spec: dict) -> list:
    """``(temporaries, activations)`` (bytes per device) of every program `TrainerBase.eval_step` runs on a
    state of ``trainer`` (a `ReversibleTrainer`) in its layout (``trainer.groups``) and batches shaped like
    ``eval_spec`` (the global evaluation batch, ``weights`` included): each group's evaluation program (a
    stacked run's scan) and the head's, bottom first; ``activations``: its input and output (the head's input
    alone). The programs are the trainer's own (`TrainerBase.eval_programs`), compiled on the arguments the
    evaluation passes them (the layers as its programs take them, `program_state`), all at once: the run's first
    evaluation finds them compiled. Kept with the trainer's programs (``trainer.programs.readings``): a later plan
    compiles nothing again."""
    key = ("eval", shape_key(eval_spec))
    readings = trainer.programs.readings
    if key in readings:
        return readings[key]
    data = NamedSharding(trainer.mesh, P(DATA_AXIS))
    place = lambda tree: jax.tree.map(  # noqa: E731
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=data), tree)
    batch = place(eval_spec)
    a = program_state(trainer, trainer.abstract_state())
    groups = tuple(trainer.groups)
    fns, head = trainer.eval_programs(groups)
    x, compiling, acts = batch[trainer.model.input_key], [], []
    n = len(trainer.model.layers) - 1
    with Compiles() as compiles:  # (each compiled while the next is traced)
        for (start, count), fn in zip(groups[:-1], fns):
            stack = (lambda tree: tree) if count == 1 else (lambda tree: stacked(tree, count))  # noqa: E731
            args = (stack(a.params[start]), stack(a.layer_state[start]), x)
            compiling.append(compiles.submit(lower_program(fn, args)))
            y = place(fn.eval_shape(*args))
            acts.append(tree_nbytes(x) + tree_nbytes(y))
            x = y
        compiling.append(compiles.submit(lower_program(head, (a.params[n], a.layer_state[n], x, batch))))
    acts.append(tree_nbytes(x))
    temps = []
    for compiled in [future.result() for future in compiling]:
        try:
            temps.append(int(compiled.memory_analysis().temp_size_in_bytes))
        except Exception:  # noqa: BLE001 (a backend without memory analysis: no temporaries known)
            temps.append(0)
    readings[key] = list(zip(temps, (b // trainer.mesh.size for b in acts)))  # (activations split over "data")
    return readings[key]


class PlanPrograms:
    """The memory plan's programs, through the program interface: for the run's own trainer (``trainer``; its
    choice ``own``, a `revtrain.planning.setups.Setup`) the programs its step runs (`step_temporaries`); for
    another choice one layer's programs of `LayerPrograms.on_mesh` on one device's (micro)batch. Results are
    cached per distinct (layer, input shapes, optimizer, kind): each compile runs once per process.

    Args:
      trainer: the run's trainer (None: every choice on one device).
      own: its `Setup` (`revtrain.planning.setups.setup_of`); a plan of that choice asks the trainer.
    """

    def __init__(self, trainer=None, own=None):
        self.trainer, self.own = trainer, own
        self.cache: dict = {}
        self._layer_programs: dict = {}
        # The walks of plans that differ in their tier only (``offload = 'auto'``): None, each plan walks its own
        # programs; a dict, the first walk of a choice is every tier's (the tiers differ in where the state
        # lives, not in the programs).
        self.shared_walks: dict | None = None

    def is_own(self, setup) -> bool:
        """Whether ``setup`` is the run's own trainer's choice (its programs are the run's)."""
        return self.trainer is not None and setup == self.own and hasattr(self.trainer, "programs")

    def layer_programs(self, model, tx, rebuild: str = "exact") -> LayerPrograms:
        """`LayerPrograms.on_mesh` of ``model`` and ``tx`` on one device (one per model, optimizer, rebuild
        flavour and update form)."""
        key = (id(model), id(tx), rebuild)
        if key not in self._layer_programs:
            self._layer_programs[key] = (LayerPrograms.on_mesh(model, tx, mesh1(), rebuild), model, tx)
        return self._layer_programs[key][0]

    def temp(self, programs: LayerPrograms, kind: str, layer, args) -> int:
        """``temp_size_in_bytes`` of ``programs.per_layer(kind, layer)`` compiled on ``args`` (abstract); 0 on a
        backend without memory analysis."""
        key = ("temp", id(programs), kind, layer, shape_key(args))
        if key not in self.cache:
            try:
                compiled = compile_program(programs.per_layer(kind, layer), args)
                self.cache[key] = int(compiled.memory_analysis().temp_size_in_bytes)
            except Exception:  # noqa: BLE001 (a backend without memory analysis: no temporaries known)
                self.cache[key] = 0
        return self.cache[key]

    def forward(self, programs: LayerPrograms, layer, params, state, x, mode) -> int:
        """The temporaries of ``layer``'s forward program in ``mode`` (a `modes.BackwardMode` below the head)."""
        return self.temp(programs, mode.program_kinds[0], layer, (params, state, x) + _KEY_AND_INDEX)

    def backward(self, programs: LayerPrograms, layer, params, opt, state, x, y, mode) -> int:
        """The temporaries of ``layer``'s backward program in ``mode`` (reverse from its output ``y``, or
        recompute from its input ``x``) with its update."""
        start = y if mode.rebuilds else x
        return self.temp(programs, mode.program_kinds[1], layer, (params, opt, state, start, y) + _KEY_AND_INDEX)

    def head(self, programs: LayerPrograms, layer, params, opt, state, x, batch) -> int:
        """The temporaries of the head's program (loss, vjp, update) alone."""
        return self.temp(programs, "head", layer, (params, opt, state, x, batch) + _KEY_AND_INDEX)

    def own_temporaries(self, batch_spec: dict) -> list:
        """`step_temporaries` of the run's own trainer (``batch_spec``: its global (micro)batch's shapes)."""
        key = ("own", shape_key(batch_spec))
        if key not in self.cache:
            self.cache[key] = step_temporaries(self.trainer, batch_spec)
        return self.cache[key]

    def own_eval_temporaries(self, eval_spec: dict) -> list:
        """`eval_temporaries` of the run's own trainer (``eval_spec``: its global evaluation batch's shapes)."""
        return eval_temporaries(self.trainer, eval_spec)

    def whole_step(self, model, setup, params, opt, states, batch) -> int:
        """``temp_size_in_bytes`` of `StandardTrainer`'s whole step (`StandardTrainer.step_program`) compiled
        for one device (on a 1.44 B Llama of 32 blocks: 12 s on two CPU cores); -1 when it does not compile."""
        from revtrain.trainers.standard import StandardTrainer
        key = ("step", id(model), shape_key(batch), id(setup.optimizer), setup.remat, setup.microbatches)
        if key not in self.cache:
            try:
                trainer = StandardTrainer(model, setup.optimizer, mesh1(), scan_layers=setup.remat,
                                          remat_layers=setup.remat, microbatches=setup.microbatches)
                compiled = compile_program(trainer.step_program(), (params, opt, states, batch, _KEY_AND_INDEX[0]))
                self.cache[key] = int(compiled.memory_analysis().temp_size_in_bytes)
            except Exception:  # noqa: BLE001 (fall back to the analytic bound)
                self.cache[key] = -1
        return self.cache[key]

    def _mapped_temp(self, key, fn, args) -> int:
        """``temp_size_in_bytes`` of ``fn(*args)`` compiled on one device inside ``shard_map`` (so that layers
        averaging over ``"data"`` trace as in the trainers)."""
        if key not in self.cache:
            from revtrain.trainers.common import XLA_OPTIONS
            mapped = jax.shard_map(fn, mesh=mesh1(), in_specs=(P(),) * len(args), out_specs=P(), check_vma=False)
            try:
                compiled = jax.jit(mapped, compiler_options=XLA_OPTIONS).lower(*args).compile()
                self.cache[key] = int(compiled.memory_analysis().temp_size_in_bytes)
            except Exception:  # noqa: BLE001 (a backend without memory analysis: no temporaries known)
                self.cache[key] = 0
        return self.cache[key]

    def eval_forward(self, layer, params, state, x) -> int:
        """``temp_size_in_bytes`` of ``layer``'s evaluation program at ``x`` (the trainers',
        `TrainerBase.eval_forward`)."""
        return self._mapped_temp(("eval", layer, shape_key(x)), functools.partial(TrainerBase.eval_forward, layer),
                                 (params, state, x))

    def eval_head(self, layer, params, state, x, batch) -> int:
        """``temp_size_in_bytes`` of the head's evaluation program (its loss sums) at ``x`` (the trainers',
        `TrainerBase.eval_loss`)."""
        return self._mapped_temp(("eval_head", layer, shape_key(x)),
                                 functools.partial(TrainerBase.eval_loss, layer), (params, state, x, batch))

    def residuals(self, layer, params, state, x, keys) -> int:
        """Bytes of the vjp residuals of ``layer`` at ``x`` (leaves of the pullback that are not inputs):
        what backprop keeps of this layer until its backward."""
        key = ("res", layer, shape_key(x))
        if key not in self.cache:
            found = []

            def fn(p, s, x, k):
                if is_float(x):
                    _, vjp = jax.vjp(lambda p, x: layer.apply(p, s, x, k, True)[0], p, x)
                else:
                    _, vjp = jax.vjp(lambda p: layer.apply(p, s, x, k, True)[0], p)
                given = {id(a) for a in jax.tree.leaves((p, s, x, k))}
                found.append(sum(tree_nbytes(a) for a in jax.tree.leaves(vjp) if id(a) not in given))
                return jnp.zeros(())

            mapped = jax.shard_map(fn, mesh=mesh1(), in_specs=(P(),) * 4, out_specs=P(), check_vma=False)
            jax.eval_shape(mapped, params, state, x, keys)
            self.cache[key] = found[0]
        return self.cache[key]

    def output(self, layer, params, state, x, keys):
        """The shapes of ``layer``'s output at ``x`` (training mode)."""
        key = ("out", layer, shape_key(x))
        if key not in self.cache:
            fn = jax.shard_map(lambda p, s, x, k: layer.apply(p, s, x, k, True)[0], mesh=mesh1(),
                               in_specs=(P(),) * 4, out_specs=P(), check_vma=False)
            self.cache[key] = jax.eval_shape(fn, params, state, x, keys)
        return self.cache[key]


# A step's key and a layer's index, as the per-layer programs take them (abstract).
_KEY_AND_INDEX = (jax.ShapeDtypeStruct((2,), jnp.uint32), np.int32(0))
