"""The streaming engine: a step's layers moved between their store and the device ahead of the programs.

A tier that keeps weights and optimizer state off the device (``ReversibleTrainer.offload = True`` or
``'disk'``) keeps each layer in a *store* between uses: host memory (`revtrain.tiers.host_store`) or files
(`revtrain.tiers.disk_store`). One engine serves both (`StepStream`): it knows the step's programs and what
each needs (`train_programs`: the forward's weights, then the head's and the backward's weights and optimizer
state, newest first, with a kept block input beside its backward's), puts each program's layers on the device
ahead of it and puts each updated layer back right after its program. The programs are the device tier's own:
they never see where a layer lives, so every tier trains bit for bit like ``offload = False``.

**The schedule** (docs/streaming.md; the GPU runtime's rules, docs/DESIGN section 14). Every transfer is issued
from the thread that dispatches the programs, in program order, and never waited on. For program k of a
step, in this order:

1. wait for program k - depth to finish (`Store.depth`, 2 on an accelerator): the one host wait, which bounds
   the layers in flight;
2. issue the puts of every program up to k + depth: each program's whole state (weights, optimizer state, a
   kept input, a gradient buffer) in one batched ``jax.device_put``;
3. dispatch program k;
4. issue the put of program k's updated layer back to the store (host memory: ``jax.device_put`` to its
   host sharding; files: handed to the writer thread) and let go of the layer's old state.

On a GPU a copy into a fresh device buffer waits for the programs queued before it is allocated, and
overlaps only those queued after it: a put issued before program k is dispatched moves in while programs k
and k + 1 compute. Host-to-device and device-to-host copies run on separate copy engines. So a step takes
about the larger of its compute and its transfers, not their sum.

**Files.** The disk tier keeps its reader thread for file I/O: it reads each program's layer files into host
buffers one program before their put is due (`Store.threaded`), and the dispatching thread issues the device
puts in the same order; the writer thread writes each updated layer's file.

**Depth on the CPU.** On the CPU backend the device's memory is host memory: every layer in flight is host
memory too, and a copy runs on the cores that compute. There the depth is 0: program k's layer is put right
before it is dispatched, once program k - 1 has finished and its updated layer is back in host memory (the
update's device buffers are then free: one layer in flight, not two; docs/streaming.md has the host memory
this saves); `Store.depth` can be set.

**Host memory as the store.** `HostStore` keeps a layer's state as JAX arrays in a host memory kind:
``unpinned_host`` (ordinary pageable memory) where the backend has it, else ``pinned_host``. A step replaces
the state layer by layer: once a layer's new state is issued its old one is let go (``release``; the
runtime keeps a buffer alive until the copies reading it are done), as donation consumes the device tier's,
so host memory holds one state and the layers in flight, never two states.

The same read-ahead / write-behind pattern moves optimizer state for ZeRO-Offload (Ren et al. 2021) and
ZeRO-Infinity (Rajbhandari et al. 2021); here it follows a reversible step's programs, one layer at a time.

Test-only: `FETCH_HOOK`, called with ``(group, part, bytes)`` for each put on the store's reader thread (a
link made slow on purpose: the program that uses the put waits for it, as a device waits for a copy);
`Recorder`, set as ``Store.recorder``, records each step's puts, dispatches and waits in order.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import deque

import jax
import numpy as np


IN_FLIGHT = 2  # `Bounded` without a step's stream: programs dispatched ahead of the device at most
DEPTH = 2  # programs ahead of its user a put is issued, and the program waited for (k - DEPTH), on an accelerator
CPU_DEPTH = 0  # the same on the CPU backend (a put right before its program): every layer in flight is RAM
FETCH_HOOK = None  # test-only: FETCH_HOOK(group, part, bytes) for each put, on the reader thread (a slow link)


def _split(kinds: list) -> tuple[int, int]:
    """``(below, last)``: the groups with programs of their own below the head's, and the head's group."""
    last = len(kinds) - 1
    top = 0
    while top < last and kinds[last - 1 - top] == "top":
        top += 1
    return last - top, last


def train_programs(kinds: list) -> list:
    """The programs of one reversible step (`ReversibleTrainer.train_step` over a plan's ``kinds``), each as
    the list of accesses ``(group, part)`` it needs (``part``: ``"params"``, ``"opt"``, ``"kept"``, a kept block
    input): the forward's weights, the head's (and those of the blocks inside its program, ``"top"``) weights
    and optimizer state, then the backward's, newest first."""
    below, last = _split(kinds)
    out = [[(g, "params")] for g in range(below)]
    out.append([(g, part) for g in range(below, last + 1) for part in ("params", "opt")])
    for g in range(below - 1, -1, -1):
        out.append([(g, "params"), (g, "opt")] + ([(g, "kept")] if kinds[g] == "std" else []))
    return out


def train_schedule(kinds: list) -> list:
    """`train_programs`' weights and optimizer state accesses, in order, as one list."""
    return [a for program in train_programs(kinds) for a in program if a[1] != "kept"]


def deferred_programs(kinds: list, microbatches: int, passes: int, owners=()) -> list:
    """The programs of one deferred-update step (`revtrain.trainers.deferred`) over a plan's ``kinds``, as
    `train_programs`: per microbatch the forward's weights, the head's program (the tied leaves' owners'
    weights, ``owners``: their groups; the weights and gradient buffers, ``"grad"``, of the blocks inside it
    and the head's), the backward's weights and buffers newest first; then ``passes`` statistics and update
    passes, each layer's weights, optimizer state and buffer."""
    below, last = _split(kinds)
    one = [[(g, "params")] for g in range(below)]
    one.append([(g, "params") for g in owners] + [(g, "params") for g in range(below, last)]
               + [(g, "grad") for g in range(below, last)] + [(last, "params"), (last, "grad")])
    for g in range(below - 1, -1, -1):
        one.append([(g, "params"), (g, "grad")] + ([(g, "kept")] if kinds[g] == "std" else []))
    passes_ = [[(g, part) for part in ("params", "opt", "grad")] for g in range(last + 1)]
    return one * microbatches + passes_ * passes


def deferred_schedule(kinds: list, microbatches: int, passes: int, owners=()) -> list:
    """`deferred_programs`' accesses but the kept inputs, in order, as one list."""
    return [a for program in deferred_programs(kinds, microbatches, passes, owners) for a in program
            if a[1] != "kept"]


def on_cpu() -> bool:
    """Whether the default backend is the CPU (its device memory is host memory)."""
    return jax.default_backend() == "cpu"


class Recorder:
    """What a store's streams did, in order (``Store.recorder``; None, the default, records nothing). Each event
    is a tuple: ``("step", step)`` at a stream's start (None: an evaluation's); ``("put", k, g, part)``, the
    put of group ``g``'s ``part`` for program ``k`` issued; ``("dispatch", k)``, program ``k`` dispatched (None:
    a program that needs no layer, e.g. a global round's); ``("back", k, g, part)``, the put of program ``k``'s
    update of group ``g`` back to the store issued (``part``: ``"state"`` or ``"grad"``); ``("wait", what, k)``:
    the dispatching thread waited, for program ``k`` (``what = "program"``), for the reader's file of program
    ``k``'s layer (``"file"``, the disk tier), or for the writer's previous file (``"write"``)."""

    def __init__(self):
        self.events: list = []

    def __call__(self, *event) -> None:
        self.events.append(event)

    def steps(self) -> list:
        """The events split at each ``("step", ...)``: one list per stream, its marker first."""
        out = []
        for e in self.events:
            if e[0] == "step":
                out.append([])
            if out:
                out[-1].append(e)
        return out


class Store:
    """Where a tier keeps its layers between uses, as the engine (`StepStream`) sees it: a *ref* per group
    (a store's own object), put on the device by ``read`` and replaced by ``write``.

    Subclasses set ``threaded`` (True: ``load`` reads a layer into host buffers on the reader thread, and
    ``write`` runs on the writer thread; False: ``read`` and ``write`` only issue copies and run on the
    dispatching thread), ``prefix`` (the name of its statistics) and implement ``holds``, ``nbytes``, ``read``
    and ``write`` (and ``load`` when threaded); ``begin``, ``unchanged`` and ``end`` frame a step.

    ``depth``: how many programs ahead of its user a put is issued, and so which program the dispatching
    thread waits for before it issues more (program k waits for k - depth, k - 1 at depth 0): `DEPTH` on an accelerator,
    `CPU_DEPTH` on the CPU backend (see the module note). ``recorder``: a `Recorder` or None.
    """

    threaded = False
    prefix = "store"
    read_ahead = DEPTH  # programs' layers put ahead of the one in use on an accelerator (what the plans count)

    def __init__(self):
        self._readers = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"revtrain-{self.prefix}-read")
        self._writers = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"revtrain-{self.prefix}-write")
        self._bounded = None  # the trainer's dispatch limiter (`bounded`): tells a step's stream of each program
        self.depth = CPU_DEPTH if on_cpu() else DEPTH
        self.recorder = None


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

    def load(self, ref, part: str):
        """A threaded store's: ``ref``'s ``part`` read into host buffers (called on the reader thread); what
        ``read`` is then given as ``loaded``."""
        raise NotImplementedError

    def read(self, items: list, place, loaded=None) -> list:
        """The device arrays of ``items`` (a list of ``(ref, part)``), their copies issued and not waited for
        (called on the dispatching thread); ``place`` puts a numpy leaf on the device; ``loaded``: a threaded
        store's `load` results, one per item."""
        raise NotImplementedError

    def write(self, step: int, g: int, ref, update: list):
        """Group ``g``'s updated state, ``update = [params, opt_state]`` (device arrays; the store empties
        the list, so its references are the last and each array is released once written), stored for step
        ``step``; returns its new ref. A threaded store's runs on the writer thread; otherwise it is called on
        the dispatching thread and only issues the copy."""
        raise NotImplementedError

    def begin(self, step: int, refs: list) -> None:
        """Prepares the step that makes ``step`` (``refs``: its state)."""

    def unchanged(self, step: int, g: int, ref):
        """The ref of group ``g`` in step ``step`` when the step did not update it."""
        return ref

    def end(self, step: int, refs: list) -> None:
        """The step that made ``step`` is complete (``refs``: the state it replaced)."""

    def bounded(self, limit) -> "Bounded":
        """The trainer's dispatch limiter: it tells the step's stream of each program dispatched
        (`StepStream.dispatched`), and without one keeps at most `IN_FLIGHT` programs ahead of the device."""
        self._bounded = Bounded(limit)
        return self._bounded

    def listen(self, stream: "StepStream") -> "StepStream":
        if self._bounded is not None:
            self._bounded.listener = stream.dispatched
        return stream

    def stream(self, refs: list, step: int, programs: list, place, release=None) -> "StepStream":
        """A training step's `StepStream` over ``refs`` (one per group) for the step that makes ``step``
        (``programs``: `train_programs`); ``release(g)``: called once group ``g``'s new state is issued (host
        memory) or written (files), to drop the caller's references to its old state (a state is replaced
        layer by layer instead of held twice to the end)."""
        self.begin(step, refs)
        return self.listen(StepStream(self, refs, step, programs, place, release=release))

    def reader(self, refs: list, place) -> "StepStream":
        """A read-only `StepStream` that puts every layer's weights on the device in order (evaluation), each
        ``depth`` programs ahead. It never writes, so ``refs`` may be a checkpoint's."""
        programs = [[(g, "params")] for g in range(len(refs))]
        return self.listen(StepStream(self, refs, None, programs, place))

    def deferred_stream(self, refs: list, step: int, place, kinds: list, microbatches: int, passes: int,
                        owners: list, grad_shapes: list, release=None) -> "DeferredStream":
        """A `DeferredStream` over ``refs`` for the deferred-update step that makes ``step``: its programs
        from the plan's ``kinds`` (`deferred_programs`), each group's gradient buffer shaped like its weights
        (``grad_shapes``: one tree of ``jax.ShapeDtypeStruct`` per group); ``release`` as in `stream`."""
        self.begin(step, refs)
        programs = deferred_programs(kinds, microbatches, passes, owners)
        return self.listen(DeferredStream(self, refs, step, programs, place, grad_shapes, release=release))

    # -- the deferred update's gradient buffers (`DeferredStream`) --
    def begin_buffers(self, step: int) -> None:
        """Prepares the gradient buffers of the step that makes ``step``."""

    def buffer_ref(self, step: int, g: int, version: int, shapes):
        """A new ref for version ``version`` of group ``g``'s gradient buffer (``shapes``: a tree of
        ``jax.ShapeDtypeStruct``), read as its ``"params"`` once `write_buffer` has filled it."""
        raise NotImplementedError

    def write_buffer(self, ref, value) -> None:
        """Stores ``value`` (device arrays) as the buffer ``ref`` (threaded: on the writer thread; else on the
        dispatching thread, issuing the copy only)."""
        raise NotImplementedError

    def drop_buffer(self, ref) -> None:
        """Lets go of a buffer that a newer version replaced."""

    def end_buffers(self, step: int) -> None:
        """Removes whatever is left of the step's gradient buffers."""

    def submit_read(self, fn, *args):
        return self._readers.submit(fn, *args)

    def submit_write(self, fn, *args):
        return self._writers.submit(fn, *args)


def _kind(tree, kind: str):
    """The shardings of ``tree``'s leaves in memory kind ``kind``."""
    return jax.tree.map(lambda x: x.sharding.with_memory_kind(kind), tree)


class Bounded:
    """Wraps the trainer's ``DispatchLimiter``: tells the step's stream (``listener``) of each program
    dispatched, with one small output of it (the stream waits on programs itself, `StepStream`). Without a
    listener it keeps one such output of each of the last `IN_FLIGHT` programs and waits for the oldest
    before a newer one is dispatched further. Only the smallest output leaf is kept (a program's outputs are
    ready together): keeping the updated weights would hold them after they were written back."""

    def __init__(self, inner):
        self.inner, self._recent = inner, deque()
        self.listener = None  # called with each program's kept output (a step's stream)

    def __call__(self, outputs):
        outputs = self.inner(outputs)
        leaves = [x for x in jax.tree.leaves(outputs) if isinstance(x, jax.Array)]
        token = min(leaves, key=lambda x: x.size) if leaves else None
        if self.listener is not None:
            self.listener(token)
            return outputs
        if token is not None:
            self._recent.append(token)
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
    """A list-like view of a `StepStream`: ``params``, ``opt_state`` or ``grad`` (``view[g]`` reads,
    ``view[g] = v`` stores an update); ``view.stream`` is the stream (the walk keeps block inputs there)."""

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
    """One step's puts and write-backs of a store's layers (or an evaluation's puts), in the schedule of the
    module note.

    ``programs``: the step's programs in order, each the list of accesses ``(group, part)`` it needs
    (`train_programs`; ``part``: ``"params"``, ``"opt"``, ``"kept"``). A program begins at the first access of
    one of its own (`get`): the stream then waits for the program ``depth`` before it, and issues the puts
    of every program up to ``depth`` after it (a program whose value is not there yet, a kept input or a
    gradient buffer not stored yet, and those after it, wait for the next program's beginning). An access
    that is in no program later than the current one is put on demand (the result is the same, only
    slower). ``put`` of a group's params and optimizer state issues the layer's write-back (host memory: at
    once; files: on the writer thread, after the previous layer's file). `finish` waits for every file
    written and returns the new ref of each group.
    """

    def __init__(self, store: Store, refs: list, step: int | None, programs: list, place, release=None):
        self.store, self.refs, self.step, self.place = store, list(refs), step, place
        self.release = release  # called with a group once its new state is issued (its old one can go)
        self.programs = [list(p) for p in programs]
        self.schedule = [a for p in self.programs for a in p if a[1] != "kept"]
        self.depth, self.recorder = store.depth, store.recorder
        self._k = -1  # the program begun last
        self._issued = self._loading = 0  # programs whose puts are issued / whose files are being read
        self._owed: list = []  # (k, g, part) whose source was not there when program k's puts were issued
        self._puts: dict = {}  # (k, g, part) -> its device tree
        self._links: dict = {}  # (k, g, part) -> Future of the test's slow link (`FETCH_HOOK`)
        self._loads: dict = {}  # (k, g, part) -> Future of its host buffers (a threaded store)
        self._used: set = set()  # (k, g, part) taken by `get`
        self._tokens: dict = {}  # k -> a small output of program k (what the bound waits on)
        self._backs: dict = {}  # k -> program k's write-backs to host memory (waited with it at depth 0)
        self._waited = -1  # programs waited for, up to this one
        self._updates: dict = {}  # g -> {part: value}
        self._kept: dict = {}  # g -> a block input kept for the backward (`keep`)
        self._writes: deque = deque()  # a threaded store's writes in progress
        self._new: dict = {}  # g -> its new ref (a threaded store: a Future of it)
        self.read_bytes = self.write_bytes = 0
        self.read_seconds = self.write_seconds = 0.0
        self._thread_seconds = 0.0  # the reader thread's busy time (files read, the test's slow link)
        self.params, self.opt_state = View(self, "params"), View(self, "opt")
        self._record("step", step)

    @property
    def tier(self) -> Store:
        return self.store

    def _record(self, *event) -> None:
        if self.recorder is not None:
            self.recorder(*event)

    # -- programs --
    def dispatched(self, token) -> None:
        """A program was dispatched (``token``: a small output of it): the program begun last, the first
        time; another (one that needs no layer) after that."""
        k = self._k
        if k >= 0 and k not in self._tokens and k > self._waited:
            self._tokens[k] = token
            self._record("dispatch", k)
        else:
            self._record("dispatch", None)

    def _begin(self, k: int) -> None:
        """Program ``k`` begins: wait for program ``k - depth`` (``k - 1`` at depth 0), then issue the puts up
        to ``k + depth``."""
        self._k = k
        for j in range(self._waited + 1, k - max(self.depth, 1) + 1):
            token, backs = self._tokens.pop(j, None), self._backs.pop(j, ())
            if token is not None or backs:
                self._record("wait", "program", j)
                wait(token)
                for back in backs:  # (depth 0: its update's copy to host memory too, `put`)
                    wait((back.params, back.opt_state))
            self._waited = j
        last = len(self.programs) - 1
        if self._owed:  # (those whose source is there now first, in order)
            owed, self._owed = self._owed, []
            for key in owed:
                if key[0] >= k and key not in self._used:
                    self._issue(key[0], [key[1:]])
        if self.store.threaded:  # files read one program ahead of their puts
            while self._loading <= min(k + self.depth + 1, last):
                self._load(self._loading)
                self._loading += 1
        while self._issued <= min(k + self.depth, last):
            self._issue(self._issued)
            self._issued += 1

    def _find(self, g: int, part: str) -> int | None:
        for k in range(max(self._k, 0), len(self.programs)):
            if (g, part) in self.programs[k] and (k, g, part) not in self._used:
                return k
        return None

    # -- what a program needs: its sources, their reads and puts --
    def _earlier(self, k: int, g: int, part: str) -> bool:
        """Whether a program before ``k`` needs ``(g, part)`` and has not taken it yet."""
        return any((g, part) in self.programs[j] and (j, g, part) not in self._used
                   for j in range(max(self._k, 0), k))

    def _source(self, k: int, g: int, part: str):
        """Where program ``k``'s ``(g, part)`` comes from: None (not there yet: wait), ``("none",)`` (nothing
        to put: `_direct` gives it), ``("store", ref, part, after)`` (a store read; ``after``: a Future the
        file's read waits for) or ``("device", tree)`` (a tree put as it is, a kept input)."""
        if part == "kept":
            if g not in self._kept or self._earlier(k, g, part):
                return None
            x = self._kept[g]
            kind = getattr(self.store, "device_kind", None)
            if kind is None or all(getattr(v.sharding, "memory_kind", kind) == kind for v in jax.tree.leaves(x)):
                return ("none",)
            return ("device", x)
        ref = self.refs[g]
        if part in self._updates.get(g, {}) or ref is None or not self.store.holds(ref):
            return ("none",)
        return ("store", ref, part, None)

    def _load(self, k: int) -> None:
        """Submits the file reads of program ``k`` whose sources are there to the reader thread."""
        for g, part in self.programs[k]:
            s = None if (k, g, part) in self._used else self._source(k, g, part)
            if s is not None and s[0] == "store" and (k, g, part) not in self._loads:
                self._loads[(k, g, part)] = self.store.submit_read(self._read_file, g, part, s[1], s[2], s[3])

    def _read_file(self, g: int, part: str, ref, which: str, after):
        if after is not None:  # (a gradient buffer: its file written first)
            after.result()
        start = time.perf_counter()
        out = self.store.load(ref, which)
        if FETCH_HOOK is not None:
            FETCH_HOOK(g, part, self.store.nbytes(ref, which))
        self._thread_seconds += time.perf_counter() - start
        return out

    def _link(self, g: int, part: str, nbytes: int) -> None:
        start = time.perf_counter()
        FETCH_HOOK(g, part, nbytes)
        self._thread_seconds += time.perf_counter() - start

    def _issue(self, k: int, accesses: list | None = None) -> None:
        """Issues the puts of program ``k`` (or of its ``accesses``): its store reads in one `Store.read`, a kept
        input's put. An access whose source is not there yet (a kept input or a gradient buffer not stored
        yet) is owed: issued at a later program's beginning, or taken on demand."""
        sources = []
        for g, part in self.programs[k] if accesses is None else accesses:
            if (k, g, part) in self._used:
                continue
            s = self._source(k, g, part)
            if s is None:
                self._owed.append((k, g, part))
            else:
                sources.append((g, part, s))
        store = self.store
        reads = [(g, part, s) for g, part, s in sources if s[0] == "store"]
        if reads:
            loaded = None
            if store.threaded:
                loaded = []
                for g, part, s in reads:
                    future = self._loads.pop((k, g, part), None)
                    if future is None:
                        future = store.submit_read(self._read_file, g, part, s[1], s[2], s[3])
                    if not future.done():
                        self._record("wait", "file", k)
                    loaded.append(future.result())
            start = time.perf_counter()
            trees = store.read([(s[1], s[2]) for _, _, s in reads], self.place, loaded)
            del loaded
            self.read_seconds += time.perf_counter() - start
            for (g, part, s), tree in zip(reads, trees, strict=True):
                nbytes = store.nbytes(s[1], s[2])
                self._puts[(k, g, part)] = tree
                self.read_bytes += nbytes
                self._record("put", k, g, part)
                if FETCH_HOOK is not None and not store.threaded:  # (a threaded store calls it after its read)
                    self._links[(k, g, part)] = store.submit_read(self._link, g, part, nbytes)
        for g, part, s in sources:
            if s[0] == "device":
                self._puts[(k, g, part)] = jax.device_put(s[1], _kind(s[1], store.device_kind))
                self._record("put", k, g, part)

    def _direct(self, g: int, part: str):
        """``(g, part)`` when nothing was put for it: an update stored this step, a kept input, a value held in
        memory, or a store read on demand."""
        if part == "kept":
            return self._kept.get(g)
        if part in self._updates.get(g, {}):
            return self._updates[g][part]
        ref = self.refs[g]
        if ref is None or not self.store.holds(ref):
            return ref
        loaded = [self.store.load(ref, part)] if self.store.threaded else None
        self.read_bytes += self.store.nbytes(ref, part)
        return self.store.read([(ref, part)], self.place, loaded)[0]

    def get(self, g: int, part: str):
        """Group ``g``'s ``part`` as device arrays (an update stored this step, if any)."""
        if part in self._updates.get(g, {}):
            return self._updates[g][part]
        k = self._find(g, part)
        if k is None:  # (not in a program to come: on demand)
            return self._direct(g, part)
        if k > self._k:
            self._begin(k)
        key = (k, g, part)
        if key in self._owed:  # (its source was not there when its program's puts were issued)
            self._owed.remove(key)
            self._issue(k, [(g, part)])
            if key in self._owed:
                self._owed.remove(key)
        self._used.add(key)
        tree = self._puts.pop(key, None)
        if tree is None:
            tree = self._direct(g, part)
        link = self._links.pop(key, None)
        if link is not None:  # the test's slow link: the program would wait for its copy
            link.result()
        if part == "kept":
            self._kept.pop(g, None)
        return tree

    def keep(self, g: int, x) -> None:
        """Keeps ``x`` (where the tier keeps a block input: `Residency.keep`) for group ``g``'s backward, whose
        program's puts bring it back to the device ahead (`bring`)."""
        self._kept[g] = x

    def bring(self, g: int):
        """Group ``g``'s kept input, on the device when the tier moves it (its put issued ahead)."""
        return self.get(g, "kept")

    # -- write-backs --
    def put(self, g: int, part: str, value) -> None:
        """Stores group ``g``'s updated ``part``; once both parts are in, the layer goes back to the store."""
        self._updates.setdefault(g, {})[part] = value
        if len(self._updates[g]) < 2 or self.step is None:
            return
        update, self._updates[g] = self._updates[g], {}
        del value
        if not self.store.threaded:  # one put back to host memory, issued and not waited for
            start = time.perf_counter()
            new = self._new[g] = self.store.write(self.step, g, self.refs[g], [update.pop("params"), update.pop("opt")])
            self.write_seconds += time.perf_counter() - start
            self.write_bytes += self.store.nbytes(new)
            self._record("back", self._k, g, "state")
            if self.depth == 0:
                # Where every layer in flight is RAM (the CPU), the next program's put waits for this copy
                # too: the update's device buffers are then free before the next layer is put, so one layer
                # is in flight, not two (docs/streaming.md).
                self._backs.setdefault(self._k, []).append(new)
            if self.release is not None:  # its old state is let go at once (the runtime holds it for the copies)
                self.refs[g] = None
                self.release(g)
            return
        self._one_write()
        # The box is the only reference the stream keeps: the writer empties it, so nothing (the executor's
        # work item neither) holds the update or the old state once written.
        box = [self.refs[g], update.pop("params"), update.pop("opt")]
        self._new[g] = self.store.submit_write(self._write, g, box)
        self._writes.append(self._new[g])
        self._record("back", self._k, g, "state")

    def _one_write(self) -> None:
        """A threaded store writes one file at a time: waits for the previous one."""
        while self._writes:
            future = self._writes.popleft()
            if not future.done():
                self._record("wait", "write", self._k)
            future.result()

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

    def _drain(self) -> None:
        try:
            self._one_write()
        finally:
            for future in self._loads.values():
                future.cancel()
            for future in self._links.values():
                future.result()
            self._loads.clear(), self._links.clear(), self._puts.clear(), self._tokens.clear(), self._kept.clear()
            self._backs.clear()

    def finish(self) -> list:
        """Waits for every file written; returns the new ref of each group (a group not updated keeps its
        state, `Store.unchanged`) and ends the step in the store (`Store.end`).

        Raises:
          OSError: a write failed (the store's error, e.g. `revtrain.tiers.disk_format.DiskTierError`).
        """
        self._drain()
        new = []
        for g, ref in enumerate(self.refs):
            if g not in self._new:
                new.append(self.store.unchanged(self.step, g, ref))
            else:
                new.append(self._new[g].result() if isinstance(self._new[g], concurrent.futures.Future)
                           else self._new[g])
        self.store.end(self.step, self.refs)
        # The replaced state is released now: the stream and its views refer to each other (a cycle that
        # only the garbage collector would break, holding a whole state's copy until it ran).
        self.refs, self._new, self._updates = [], {}, {}
        return new

    def stats(self) -> dict:
        """Bytes of this step's puts and write-backs; seconds: issuing them on the dispatching thread plus the
        threads' busy time (files read and written)."""
        p = self.store.prefix
        return {f"{p}_read_bytes": self.read_bytes, f"{p}_write_bytes": self.write_bytes,
                f"{p}_read_seconds": self.read_seconds + self._thread_seconds,
                f"{p}_write_seconds": self.write_seconds}


class DeferredStream(StepStream):
    """One deferred-update step's puts and write-backs of a store's layers (`revtrain.trainers.deferred`):
    `StepStream` with a third part per group, ``"grad"``, the layer's whole-step gradient buffer.

    The buffer lives in the store as the weights and optimizer state do (host memory, or files on the disk
    tier: `Store.buffer_ref`): each store (``put(g, "grad", value)``, after each microbatch's backward of the
    layer) goes back as a new version (a put to host memory, or the writer thread's file), and the version it
    replaces is dropped; each use (the next microbatch's backward, the statistics and update passes) is put
    ahead as the weights are. The first microbatch's buffer is zeros made at its use (nothing read). The
    buffers never outlive their step: the update pass consumes them before the step ends
    (`Store.end_buffers`), so a checkpoint never holds a pending gradient.

    ``programs``: `deferred_programs`. A buffer's next put is never issued before its previous store: the
    puts stop at the program whose buffer was read and not stored yet.
    """

    def __init__(self, store: Store, refs: list, step: int, programs: list, place, grad_shapes: list,
                 release=None):
        n = len(refs)
        self.count, self.grad_shapes = n, list(grad_shapes)
        self._awaiting: set = set()  # groups whose buffer was read and not stored yet
        self._versions: dict = {}  # group -> buffer versions written
        self._grad_refs: list = [None] * n  # each group's newest buffer
        self._grad_writes: dict = {}  # group -> Future of its newest buffer's file (a threaded store)
        self._grad_held: dict = {}  # group -> its newest buffer kept on the device (its next use is near)
        super().__init__(store, refs, step, programs, place, release=release)
        store.begin_buffers(step)
        self.grads = View(self, "grad")

    def _source(self, k: int, g: int, part: str):
        if part != "grad":
            return super()._source(k, g, part)
        if g in self._awaiting or self._earlier(k, g, part):
            return None
        ref = self._grad_refs[g]
        if ref is None or g in self._grad_held:
            return ("none",)
        return ("store", ref, "params", self._grad_writes.get(g))

    def _direct(self, g: int, part: str):
        if part != "grad":
            return super()._direct(g, part)
        if g in self._grad_held:  # (held to its last use: the update pass, which consumes it)
            return self._grad_held[g] if self._find(g, "grad") is not None else self._grad_held.pop(g)
        ref = self._grad_refs[g]
        if ref is None:  # the first microbatch's: zeros
            return jax.tree.map(lambda x: self.place(np.zeros(x.shape, x.dtype)), self.grad_shapes[g])
        written = self._grad_writes.get(g)
        if written is not None:
            written.result()  # read on demand: its file must be complete
        loaded = [self.store.load(ref, "params")] if self.store.threaded else None
        self.read_bytes += self.store.nbytes(ref, "params")
        return self.store.read([(ref, "params")], self.place, loaded)[0]

    def get(self, g: int, part: str):
        """Group ``g``'s ``part`` as device arrays; ``"grad"``: its buffer (zeros before the first store)."""
        tree = super().get(g, part)
        if part == "grad" and not any(p == "opt" for _, p in self.programs[self._k]):
            self._awaiting.add(g)  # (an accumulating program's: it stores the buffer; a pass's does not)
        return tree

    def put(self, g: int, part: str, value) -> None:
        """Stores group ``g``'s ``part``; ``"grad"``: a new version at once (a threaded store's after the
        previous file), the version it replaces dropped."""
        if part != "grad":
            return super().put(g, part, value)
        self._awaiting.discard(g)
        old = self._grad_refs[g]
        if self._next_use(g) <= self._k + self.depth:
            # Its next program's puts are due already (the statistics pass right after the last backward of
            # the first layers): it stays on the device for it, no round trip to the store.
            self._grad_held[g] = value
            self._grad_refs[g] = None
            if old is not None:
                self.store.drop_buffer(old)
            return
        version = self._versions[g] = self._versions.get(g, 0) + 1
        ref = self._grad_refs[g] = self.store.buffer_ref(self.step, g, version, self.grad_shapes[g])
        if self.store.threaded:
            self._one_write()
            future = self.store.submit_write(self._write_grad, ref, [value])
            self._writes.append(future)
            self._grad_writes[g] = future
        else:
            start = time.perf_counter()
            self.store.write_buffer(ref, value)
            self.write_seconds += time.perf_counter() - start
            self.write_bytes += self.store.nbytes(ref, "params")
        del value
        self._record("back", self._k, g, "grad")
        if old is not None:  # read already (it was this store's input)
            self.store.drop_buffer(old)

    def _next_use(self, g: int) -> int:
        """The next program that reads group ``g``'s buffer (past the end: none)."""
        k = self._find(g, "grad")
        return len(self.programs) if k is None else k

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
        self._grad_refs, self._grad_held = [], {}
        return super().finish()

