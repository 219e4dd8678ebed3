"""The streaming engine: a step's layers moved between their store and the device ahead of the programs.

A tier that keeps weights and optimizer state off the device (``ReversibleTrainer.offload = True`` or
``'disk'``) keeps each layer in a *store* between uses: host memory (`HostStore`) or files
(`revtrain.disk_tier.DiskTier`). One engine serves both (`StepStream`): it knows the step's access schedule
(`train_schedule`: the forward's weights, then the head's and the backward's weights and optimizer state,
newest first), fetches each layer to the device on a reader thread ahead of the program that needs it, and
hands each updated layer to a writer thread that puts it back in the store while the next layer computes.
The programs are the device tier's own: they never see where a layer lives, so every tier trains bit for
bit like ``offload = False``.

**Overlap.** A fetch is submitted when a program is dispatched and starts once the program ``ahead`` before
that one has run (`Store.ahead`): it may overlap the ``ahead`` programs before its user. With host memory
(``ahead = 2``) a layer moves in while the layers before it compute, and each updated layer moves out while
the next one computes: a step takes about the larger of its compute and its transfers, not their sum (the
transfers run on the threads; XLA's runtime runs the copies on its own transfer streams). With ``ahead = 0`` (files) a read starts only
once the program before has run, so it never shares memory with that program's temporaries: the disk tier's
plan keeps its peak at three layers, and the read hides behind the previous layer's write, which bounds a
disk-tier step anyway (docs/disk.md).

**Bounded.** At most `IN_FLIGHT` programs are dispatched ahead of the device (`Bounded`), at most
`Store.read_ahead` layers' state is fetched ahead beyond the one being used (host 2, disk 1), and one layer is
written at a time: the device holds the layer computing, those fetched ahead and the one being written back.

**Host memory as the store.** `HostStore` keeps a layer's state as JAX arrays in a host memory kind:
``unpinned_host`` (ordinary pageable memory) where the backend has it, so the state is not held in the
runtime's pinned pool (on a GPU that pool grows by doubling regions and is capped, 64 GB by default), else
``pinned_host``. The runtime stages a pageable copy through its own pinned buffers. A step replaces the
state layer by layer: once a layer's new state is written its old one is let go (``release``), as donation
consumes the device tier's, so host memory holds one state and the layers in flight, never two states.

The same read-ahead / write-behind pattern moves optimizer state for ZeRO-Offload (Ren et al. 2021) and
ZeRO-Infinity (Rajbhandari et al. 2021); here it follows a reversible step's schedule, one layer at a time.

Test-only: `FETCH_HOOK`, called on the reader thread after each fetch with ``(group, part, bytes)`` (a test
makes the link slow on purpose); every stream records its fetches and dispatches in ``events``.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import deque

import jax
import numpy as np

from revtrain import optstate


IN_FLIGHT = 2  # programs dispatched ahead of the device at most (each holds its layer's state)
FETCH_HOOK = None  # test-only: called as FETCH_HOOK(group, part, bytes) on the reader thread after each fetch


def train_schedule(kinds: list) -> list:
    """The accesses of one reversible step (`ReversibleTrainer.train_step` over a plan's ``kinds``): the
    forward's weights, the head's (and those of the backprop blocks inside its program, ``"top"``) weights
    and optimizer state, then the backward's, newest first."""
    last = len(kinds) - 1
    top = 0
    while top < last and kinds[last - 1 - top] == "top":
        top += 1
    below = last - top
    out = [(g, "params") for g in range(below)]
    for g in range(below, last + 1):
        out += [(g, "params"), (g, "opt")]
    for g in range(below - 1, -1, -1):
        out += [(g, "params"), (g, "opt")]
    return out


def deferred_schedule(kinds: list, microbatches: int, passes: int, owners=()) -> list:
    """The accesses of one deferred-update step (`revtrain.trainers.deferred`) over a plan's ``kinds``: per
    microbatch the forward's weights, the tied leaves' owners' weights (``owners``: their groups), the
    weights and buffers of the head's program (the blocks inside it first), the backward's weights and
    buffers newest first; then ``passes`` statistics and update passes, each layer's weights, optimizer
    state and buffer in order."""
    last = len(kinds) - 1
    top = 0
    while top < last and kinds[last - 1 - top] == "top":
        top += 1
    below = last - top
    one = [(g, "params") for g in range(below)] + [(g, "params") for g in owners]
    one += [(g, "params") for g in range(below, last)] + [(g, "grad") for g in range(below, last)]
    one += [(last, "params"), (last, "grad")]
    for g in range(below - 1, -1, -1):
        one += [(g, "params"), (g, "grad")]
    passes_ = [(g, part) for g in range(last + 1) for part in ("params", "opt", "grad")]
    return one * microbatches + passes_ * passes


class Store:
    """Where a tier keeps its layers between uses, as the engine (`StepStream`) sees it: a *ref* per group
    (a store's own object), fetched to the device by ``read`` and replaced by ``write``; one reader and one
    writer thread.

    Subclasses set ``ahead`` (programs before its user a fetch may overlap), ``read_ahead``, ``prefix`` (the name of its statistics) and
    implement ``holds``, ``nbytes``, ``read`` and ``write``; ``begin``, ``unchanged`` and ``end`` frame a step.
    """

    ahead = 0
    read_ahead = 1  # layers' state fetched ahead at most, beyond the one in use
    prefix = "store"

    def __init__(self):
        self._readers = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"revtrain-{self.prefix}-read")
        self._writers = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"revtrain-{self.prefix}-write")
        self._bounded = None  # the trainer's dispatch limiter (`bounded`): tells a step's stream of each program

    def holds(self, ref) -> bool:
        """Whether ``ref`` is this store's (else a value held in memory, used as it is)."""
        raise NotImplementedError

    def refs(self, params: list, opt_state: list) -> list:
        """A state's per-group ``params`` and ``opt_state`` lists (a `TrainState`'s) as this store's refs."""
        raise NotImplementedError

    def state(self, refs: list) -> tuple[list, list]:
        """The per-group ``(params, opt_state)`` lists of a `TrainState` holding ``refs`` (`refs`' inverse)."""
        raise NotImplementedError

    def nbytes(self, ref, part: str | None = None) -> int:
        """Bytes of ``ref``'s ``part`` (``"params"``, ``"opt"``; None: both)."""
        raise NotImplementedError

    def read(self, ref, part: str, place):
        """``ref``'s ``part`` as device arrays (``place`` puts a numpy leaf on the device), complete when it
        returns (called on the reader thread)."""
        raise NotImplementedError

    def write(self, step: int, g: int, ref, update: list):
        """Group ``g``'s updated state, ``update = [params, opt_state]`` (device arrays; the store empties
        the list, so its references are the last and each array is released once written), stored for step
        ``step``; returns its new ref (called on the writer thread)."""
        raise NotImplementedError

    def begin(self, step: int, refs: list) -> None:
        """Prepares the step that makes ``step`` (``refs``: its state)."""

    def unchanged(self, step: int, g: int, ref):
        """The ref of group ``g`` in step ``step`` when the step did not update it."""
        return ref

    def end(self, step: int, refs: list) -> None:
        """The step that made ``step`` is complete (``refs``: the state it replaced)."""

    def bounded(self, limit) -> "Bounded":
        """The trainer's dispatch limiter with at most `IN_FLIGHT` programs ahead of the device; it tells the
        step's stream of each program dispatched (`StepStream.dispatched`)."""
        self._bounded = Bounded(limit)
        return self._bounded

    def listen(self, stream: "StepStream") -> "StepStream":
        if self._bounded is not None:
            self._bounded.listener = stream.dispatched
        return stream

    def stream(self, refs: list, step: int, schedule: list, place, release=None) -> "StepStream":
        """A training step's `StepStream` over ``refs`` (one per group) for the step that makes ``step``;
        ``release(g)``: called once group ``g``'s new state is written, to drop the caller's references to its
        old state (the host store: a state is replaced layer by layer instead of held twice to the end)."""
        self.begin(step, refs)
        return self.listen(StepStream(self, refs, step, schedule, place, release=release))

    def reader(self, refs: list, place) -> "StepStream":
        """A read-only `StepStream` that fetches every layer's weights in order (evaluation): at most one
        layer's weights ahead. It never writes, so ``refs`` may be a checkpoint's."""
        schedule = [(g, "params") for g in range(len(refs))]
        budget = max((self.nbytes(r, "params") for r in refs if self.holds(r)), default=0)
        return StepStream(self, refs, None, schedule, place, budget=budget)

    def deferred_stream(self, refs: list, step: int, place, kinds: list, microbatches: int, passes: int,
                        owners: list, grad_shapes: list, release=None) -> "DeferredStream":
        """A `DeferredStream` over ``refs`` for the deferred-update step that makes ``step``: its accesses
        from the plan's ``kinds`` (`deferred_schedule`), each group's gradient buffer shaped like its weights
        (``grad_shapes``: one tree of ``jax.ShapeDtypeStruct`` per group); ``release`` as in `stream`."""
        self.begin(step, refs)
        schedule = deferred_schedule(kinds, microbatches, passes, owners)
        return self.listen(DeferredStream(self, refs, step, schedule, place, grad_shapes, release=release))

    # -- the deferred update's gradient buffers (`DeferredStream`) --
    def begin_buffers(self, step: int) -> None:
        """Prepares the gradient buffers of the step that makes ``step``."""

    def buffer_ref(self, step: int, g: int, version: int, shapes):
        """A new ref for version ``version`` of group ``g``'s gradient buffer (``shapes``: a tree of
        ``jax.ShapeDtypeStruct``), read as its ``"params"`` once `write_buffer` has filled it."""
        raise NotImplementedError

    def write_buffer(self, ref, value) -> None:
        """Stores ``value`` (device arrays) as the buffer ``ref`` (called on the writer thread)."""
        raise NotImplementedError

    def drop_buffer(self, ref) -> None:
        """Lets go of a buffer that a newer version replaced."""

    def end_buffers(self, step: int) -> None:
        """Removes whatever is left of the step's gradient buffers."""

    def submit_read(self, fn, *args):
        return self._readers.submit(fn, *args)

    def submit_write(self, fn, *args):
        return self._writers.submit(fn, *args)


class HostLayer:
    """One group's weights and optimizer state in host memory (`HostStore`'s ref): trees of JAX arrays in a
    host memory kind, with the shardings they had when placed (``shard_state`` splits survive a fetch)."""

    __slots__ = ("params", "opt_state")

    def __init__(self, params, opt_state):
        self.params, self.opt_state = params, opt_state

    def part(self, part: str):
        return self.params if part == "params" else self.opt_state


def _nbytes(tree) -> int:
    return sum(optstate.nbytes(x) for x in jax.tree.leaves(tree))  # (typed PRNG keys too)


class HostStore(Store):
    """The host tier's store (``offload = True``): each group's state as JAX arrays in host memory
    (`HostLayer`), fetched with one ``jax.device_put`` per tree and put back the same way. A fetch may overlap
    the two programs before its user (``ahead = 2``) and up to two layers are fetched ahead (``read_ahead =
    2``), so the reader never waits for the dispatch of the program between (docs/streaming.md has the
    measurement behind both)."""

    ahead = 2
    read_ahead = 2
    prefix = "host"

    def __init__(self, memory_kind: str | None, device_kind: str):
        super().__init__()
        self.memory_kind = memory_kind  # where a gradient buffer is kept (`write_buffer`)
        self.device_kind = device_kind  # the memory kind a fetch moves a layer to (`placement.DEVICE_MEMORY`)

    def _on_device(self, tree):
        return jax.tree.map(lambda x: x.sharding.with_memory_kind(self.device_kind), tree)

    def holds(self, ref) -> bool:
        return isinstance(ref, HostLayer)

    def refs(self, params: list, opt_state: list) -> list:
        return [HostLayer(p, o) for p, o in zip(params, opt_state, strict=True)]

    def state(self, refs: list) -> tuple[list, list]:
        return [r.params for r in refs], [r.opt_state for r in refs]

    def nbytes(self, ref, part: str | None = None) -> int:
        if part is None:
            return _nbytes(ref.params) + _nbytes(ref.opt_state)
        return _nbytes(ref.part(part))

    def read(self, ref, part: str, place):
        tree = ref.part(part)
        if all(isinstance(x, jax.Array) for x in jax.tree.leaves(tree)):
            return jax.block_until_ready(jax.device_put(tree, self._on_device(tree)))
        # (numpy leaves: a checkpoint of another tier restored for reading, e.g. an evaluation's)
        return jax.block_until_ready(jax.tree.map(
            lambda x: jax.device_put(x, self._on_device(x)) if isinstance(x, jax.Array) else place(x), tree))

    def write(self, step: int, g: int, ref, update: list):
        params, opt_state = update
        update.clear()
        params = jax.device_put(params, jax.tree.map(lambda x: x.sharding, ref.params))
        opt_state = jax.device_put(opt_state, jax.tree.map(lambda x: x.sharding, ref.opt_state))
        return HostLayer(*jax.block_until_ready((params, opt_state)))

    def buffer_ref(self, step: int, g: int, version: int, shapes):
        return HostLayer(shapes, ())  # (its params, shapes until `write_buffer` puts the values there)

    def write_buffer(self, ref, value) -> None:
        kind = self.memory_kind
        ref.params = jax.block_until_ready(
            jax.device_put(value, jax.tree.map(lambda x: x.sharding.with_memory_kind(kind), value)))


class Bounded:
    """Wraps the trainer's ``DispatchLimiter``: keeps one small output of each of the last `IN_FLIGHT` programs
    and waits for the oldest before a newer one is dispatched further, so the host never runs more than that
    many layers ahead of the device (each dispatched program holds its layer's state). Only the smallest
    output leaf is kept (a program's outputs are ready together): keeping the updated weights would hold
    them after the writer has written and released them."""

    def __init__(self, inner):
        self.inner, self._recent = inner, deque()
        self.listener = None  # called with each program's kept output (a training step's stream)

    def __call__(self, outputs):
        outputs = self.inner(outputs)
        leaves = [x for x in jax.tree.leaves(outputs) if isinstance(x, jax.Array)]
        if leaves:
            self._recent.append(min(leaves, key=lambda x: x.size))
            if self.listener is not None:
                self.listener(self._recent[-1])
        if len(self._recent) > IN_FLIGHT:
            wait(self._recent.popleft())
        return outputs

    def clear(self) -> None:
        self._recent.clear()
        self.listener = None


def wait(tree) -> None:
    """Waits for every live JAX array of ``tree`` (one donated meanwhile: the program it went to ran after)."""
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted():
            try:
                x.block_until_ready()
            except RuntimeError:  # (donated to a later program meanwhile: that one ran after it)
                pass


class View:
    """A list-like view of a `StepStream`: ``params`` or ``opt_state`` (``view[g]`` reads, ``view[g] = v``
    stores an update)."""

    def __init__(self, stream: "StepStream", part: str):
        self.stream, self.part = stream, part

    def __getitem__(self, g):
        if isinstance(g, slice):  # the backprop blocks inside the head's program, as a list
            return [self.stream.get(k, self.part) for k in range(*g.indices(len(self)))]
        return self.stream.get(g, self.part)

    def __setitem__(self, g, value):
        if isinstance(g, slice):
            for k, v in zip(range(*g.indices(len(self))), value, strict=True):
                self.stream.put(k, self.part, v)
            return
        self.stream.put(g, self.part, value)

    def __len__(self):
        return len(self.stream.refs)


class StepStream:
    """One step's fetches and write-backs of a store's layers (or an evaluation's fetches).

    ``schedule``: the expected accesses, ``(group, "params" | "opt")`` in order. Fetches run ahead on the
    store's reader thread (at most ``budget`` bytes, default one layer's state, fetched but not yet used); an
    access that is not the next expected one is fetched on demand (the result is the same, only slower). A
    training step's fetches are submitted as each program is dispatched (`dispatched`) and start once the
    program ``store.ahead`` before it has run (see the module note). ``put`` of a group's params and
    optimizer state hands both to the writer thread, waiting first for the previous layer's write, so at
    most one layer is being written while the next computes. `finish` waits for every write and returns
    the new ref of each group.
    """

    def __init__(self, store: Store, refs: list, step: int | None, schedule: list, place, budget: int | None = None,
                 release=None):
        self.store, self.refs, self.step, self.place = store, list(refs), step, place
        self.release = release  # called with a group once its new state is written (its old one can go)
        self.schedule, self._next, self._submitted = list(schedule), 0, 0
        self._pending: dict = {}  # (g, part) -> Future of the tree
        self._updates: dict = {}  # g -> {part: value}
        self._writes: deque = deque()
        self._new: dict = {}  # g -> Future of its new ref
        if budget is None:  # bytes fetched ahead at most (beyond the first fetch): `Store.read_ahead` layers' state
            budget = store.read_ahead * max((store.nbytes(r) for r in refs if store.holds(r)), default=0)
        self.budget = budget
        self.read_bytes = self.write_bytes = 0
        self.read_seconds = self.write_seconds = 0.0
        # ("fetch", g, part, start, end, index of the program it waited for or None), ("dispatch", k, time)
        self.events: list = []
        self.params, self.opt_state = View(self, "params"), View(self, "opt")
        self._dispatched = 0
        self._gates: deque = deque(maxlen=store.ahead + 1)  # the last programs dispatched
        self._gate = None  # fetches submitted now start after this program ran (None: at once)
        self._refill()

    @property
    def tier(self) -> Store:
        return self.store

    def dispatched(self, token) -> None:
        """A program was dispatched (``token``: one of its outputs): fetches ahead are submitted, each to
        start once the program ``store.ahead`` before it has run."""
        self.events.append(("dispatch", self._dispatched, time.perf_counter()))
        self._dispatched += 1
        self._gates.append(token)
        self._gate = self._gates[0] if len(self._gates) == self._gates.maxlen else None
        self._refill()

    def _read(self, g: int, part: str, gate=None, after=None):
        if gate is not None:
            wait(gate)
        ref = self.refs[g]
        start = time.perf_counter()
        tree = self.store.read(ref, part, self.place)
        nbytes = self.store.nbytes(ref, part)
        if FETCH_HOOK is not None:
            FETCH_HOOK(g, part, nbytes)
        end = time.perf_counter()
        self.events.append(("fetch", g, part, start, end, after))
        self.read_seconds += end - start
        self.read_bytes += nbytes
        return tree

    def _not_yet(self, g: int) -> bool:
        """Whether fetching ahead must stop before group ``g`` (a subclass's: a value not written yet)."""
        return False

    def _submit(self, g: int, part: str):
        """Submits the fetch of group ``g``'s ``part`` to the store's reader: its Future."""
        after = None if self._gate is None else self._dispatched - 1 - self.store.ahead  # (the gate's index)
        return self.store.submit_read(self._read, g, part, self._gate, after)

    def _refill(self) -> None:
        store = self.store
        ahead = sum(store.nbytes(self.refs[g], p) for g, p in self._pending)
        k = max(self._next, self._submitted)  # the schedule's first entry not submitted yet
        while k < len(self.schedule):
            g, part = self.schedule[k]
            if self._not_yet(g):
                break
            ref = self.refs[g]
            if not store.holds(ref) or g in self._updates:  # (a value held in memory: nothing to fetch)
                k += 1
                continue
            if (g, part) in self._pending:  # an earlier access of the same part, not used yet: in order
                break
            size = store.nbytes(ref, part)
            if self._pending and ahead + size > self.budget:
                break
            self._pending[(g, part)] = self._submit(g, part)
            ahead += size
            k += 1
        self._submitted = k

    def get(self, g: int, part: str):
        """Group ``g``'s ``part`` as device arrays (an update stored this step, if any)."""
        if part in self._updates.get(g, {}):
            return self._updates[g][part]
        ref = self.refs[g]
        if not self.store.holds(ref):  # a state held in memory (e.g. a weights-only restore)
            return ref
        try:
            k = self.schedule.index((g, part), self._next)
            self._next = k + 1
        except ValueError:
            pass
        future = self._pending.pop((g, part), None)
        tree = future.result() if future is not None else self._read(g, part)
        if self.step is None:  # (evaluation: fetch on at once; a training step fetches on at its next program)
            self._refill()
        return tree

    def put(self, g: int, part: str, value) -> None:
        """Stores group ``g``'s updated ``part``; once both parts are in, the layer is written back."""
        self._updates.setdefault(g, {})[part] = value
        if len(self._updates[g]) < 2 or self.step is None:
            return
        while self._writes:  # one layer written at a time: wait for the previous one
            self._done(self._writes.popleft())
        update, self._updates[g] = self._updates[g], {}
        # The box is the only reference the stream keeps: the writer empties it, so nothing (the executor's
        # work item neither) holds the update or the old state once written.
        box = [self.refs[g], update.pop("params"), update.pop("opt")]
        self._new[g] = self.store.submit_write(self._write, g, box)
        self._writes.append((g, None, self._new[g]))

    def _write(self, g, box):
        ref = box.pop(0)  # (``box`` is now ``[params, opt_state]``, the store's to empty)
        start = time.perf_counter()
        new = self.store.write(self.step, g, ref, box)
        self.write_seconds += time.perf_counter() - start
        self.write_bytes += self.store.nbytes(new)
        if self.release is not None:  # the step's last use of group g: its old state is let go at once
            self.refs[g] = None
            self.release(g)
        return new

    def _done(self, entry) -> None:
        entry[2].result()

    def _drain(self) -> None:
        try:
            while self._writes:
                self._done(self._writes.popleft())
        finally:
            for future in self._pending.values():
                future.cancel()
            self._pending.clear()

    def finish(self) -> list:
        """Waits for every write; returns the new ref of each group (a group not updated keeps its state,
        `Store.unchanged`) and ends the step in the store (`Store.end`).

        Raises:
          OSError: a write failed (the store's error, e.g. `revtrain.disk_tier.DiskTierError`).
        """
        self._drain()
        new = [self._new[g].result() if g in self._new else self.store.unchanged(self.step, g, ref)
               for g, ref in enumerate(self.refs)]
        self.store.end(self.step, self.refs)
        # The replaced state is released now: the stream and its views refer to each other (a cycle that
        # only the garbage collector would break, holding a whole state's copy until it ran).
        self.refs, self._new, self._updates = [], {}, {}
        return new

    def stats(self) -> dict:
        """Bytes and seconds of this step's fetches and writes (background threads' busy time)."""
        p = self.store.prefix
        return {f"{p}_read_bytes": self.read_bytes, f"{p}_write_bytes": self.write_bytes,
                f"{p}_read_seconds": self.read_seconds, f"{p}_write_seconds": self.write_seconds}


class DeferredStream(StepStream):
    """One deferred-update step's reads and writes of a store's layers (`revtrain.trainers.deferred`):
    `StepStream` with a third part per group, ``"grad"``, the layer's whole-step gradient buffer.

    The buffer lives in the store as the weights and optimizer state do (host memory, or files on the disk
    tier: `Store.buffer_ref`): each store (``put(g, "grad", value)``, after each microbatch's backward of the
    layer) is written by the store's writer thread as a new version, and the version it replaces is dropped;
    each use (the next microbatch's backward, the statistics and update passes) is read ahead by the reader
    thread as the weights are. The first microbatch's buffer is zeros made at its use (nothing read). The
    device holds the layers in flight, each now with its gradient beside its weights (and optimizer state in
    the passes); the store two versions of one buffer at most besides the others. The buffers never outlive
    their step: the update pass consumes them before the step ends (`Store.end_buffers`), so a checkpoint
    never holds a pending gradient.

    ``schedule``: the expected accesses ``(group, "params" | "opt" | "grad")`` in order
    (`deferred_schedule`). A buffer's next read is never submitted before its previous store: read-ahead
    stops at the schedule entry of a buffer that was read and not stored yet.
    """

    def __init__(self, store: Store, refs: list, step: int, schedule: list, place, grad_shapes: list,
                 release=None):
        n = len(refs)
        self.count, self.grad_shapes = n, list(grad_shapes)
        self._awaiting: set = set()  # groups whose buffer was read and not stored yet
        self._versions: dict = {}  # group -> buffer versions written
        self._grad_writes: dict = {}  # group -> Future of its newest buffer's write
        # A buffer is entry ``n + g`` of the stream's refs (read as its "params").
        entries = [(g + n, "params") if part == "grad" else (g, part) for g, part in schedule]
        super().__init__(store, list(refs) + [None] * n, step, entries, place, release=release)
        store.begin_buffers(step)
        self.grads = View(self, "grad")

    def _not_yet(self, g: int) -> bool:
        n = self.count
        return g >= n and g - n in self._awaiting  # a buffer whose newest value is not stored yet

    def _submit(self, g: int, part: str):
        n = self.count
        written = self._grad_writes.get(g - n) if g >= n else None
        after = None if self._gate is None else self._dispatched - 1 - self.store.ahead
        return self.store.submit_read(self._read_after, g, part, self._gate, after, written)

    def _read_after(self, g: int, part: str, gate, after, written):
        if written is not None:  # (the reader waits for the writer's copy)
            written.result()
        return self._read(g, part, gate, after)

    def get(self, g: int, part: str):
        """Group ``g``'s ``part`` as device arrays; ``"grad"``: its buffer (zeros before the first store)."""
        if part != "grad":
            return super().get(g, part)
        n = self.count
        self._awaiting.add(g)
        if self.refs[g + n] is not None:
            future = self._grad_writes.get(g)
            if future is not None and (g + n, "params") not in self._pending:
                future.result()  # read on demand: its write must be complete
            return super().get(g + n, "params")
        try:
            self._next = self.schedule.index((g + n, "params"), self._next) + 1
        except ValueError:
            pass
        return jax.tree.map(lambda x: self.place(np.zeros(x.shape, x.dtype)), self.grad_shapes[g])

    def put(self, g: int, part: str, value) -> None:
        """Stores group ``g``'s ``part``; ``"grad"``: written as a new version at once (after the previous
        write), the version it replaces dropped."""
        if part != "grad":
            return super().put(g, part, value)
        n = self.count
        self._awaiting.discard(g)
        while self._writes:  # one write at a time
            self._done(self._writes.popleft())
        old = self.refs[g + n]
        version = self._versions[g] = self._versions.get(g, 0) + 1
        ref = self.refs[g + n] = self.store.buffer_ref(self.step, g, version, self.grad_shapes[g])
        future = self.store.submit_write(self._write_grad, ref, [value])
        del value
        self._writes.append((g + n, None, future))
        self._grad_writes[g] = future
        if old is not None:  # read already (it was this store's input)
            self.store.drop_buffer(old)

    def _write_grad(self, ref, box):
        start = time.perf_counter()
        self.store.write_buffer(ref, box.pop())
        self.write_seconds += time.perf_counter() - start
        self.write_bytes += self.store.nbytes(ref, "params")

    def finish(self) -> list:
        """`StepStream.finish` after every write; the gradient buffers dropped first."""
        try:
            self._drain()
        finally:
            self.store.end_buffers(self.step)
        self.refs = self.refs[:self.count]
        return super().finish()
