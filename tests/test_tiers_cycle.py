"""revtrain/tiers/cycle.py: `LayerCycle`, a threaded store's layers read one ahead of generation's cycle.

In process, on an in-memory threaded store (`revtrain.streaming.Store`'s protocol, each layer's weights a numpy
tree behind a ref, every read recorded with the thread that made it): milliseconds. The disk tier's own files
through the same reader: tests/test_disk_tier.py::test_layer_cycle_reads_each_layer_per_pass_and_one_ahead.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from revtrain.streaming import Store
from revtrain.tiers.cycle import LayerCycle


class _Ref:
    def __init__(self, i: int, tree: dict):
        self.i, self.tree = i, tree


class _MemoryStore(Store):
    """A threaded store holding each layer's weights as numpy leaves; ``loads`` records ``(layer, thread
    name)`` per `load`; ``broken`` layers raise."""

    threaded = True
    prefix = "test-cycle"

    def __init__(self):
        super().__init__()
        self.loads: list = []
        self.broken: set = set()

    def holds(self, ref) -> bool:
        return isinstance(ref, _Ref)

    def nbytes(self, ref, part=None) -> int:
        return sum(x.nbytes for x in ref.tree.values())

    def load(self, ref, part):
        self.loads.append((ref.i, threading.current_thread().name))
        if ref.i in self.broken:
            raise OSError(f"layer {ref.i}: cannot read")
        return {k: v.copy() for k, v in ref.tree.items()}

    def read(self, items, place, loaded=None):
        return [{k: place(v) for k, v in tree.items()} for tree in loaded]


def _refs(n: int) -> list:
    return [_Ref(i, {"w": np.full((2, 3), i, np.float32), "b": np.arange(3, dtype=np.float32) + i})
            for i in range(n)]


def _layer(tree) -> int:
    return int(tree["w"][0, 0])


def test_each_layer_is_handed_over_in_order_and_the_next_read_on_the_reader_thread():
    store, refs = _MemoryStore(), _refs(3)
    cycle = LayerCycle(store, refs)
    got = [_layer(cycle.get(i)) for i in [0, 1, 2, 0, 1, 2, 0]]
    cycle.close()
    assert got == [0, 1, 2, 0, 1, 2, 0]
    # The first layer on demand, each next one ahead, each once; the one ahead of the last handed over (layer 1)
    # read too unless `close` cancelled it before it ran.
    reads = [i for i, _ in store.loads]
    assert reads in ([0, 1, 2, 0, 1, 2, 0], [0, 1, 2, 0, 1, 2, 0, 1]), reads
    assert store.loads[0][1] == threading.current_thread().name
    assert all(name.startswith("revtrain-test-cycle-read") for _, name in store.loads[1:])
    assert cycle.read_bytes == len(reads) * store.nbytes(refs[0])  # (every read counted)


def test_an_unexpected_layer_is_read_on_demand_and_the_read_ahead_dropped():
    store, refs = _MemoryStore(), _refs(4)
    cycle = LayerCycle(store, refs)
    assert _layer(cycle.get(0)) == 0  # (layer 1 read ahead)
    assert _layer(cycle.get(3)) == 3  # out of order: layer 1's read finished or cancelled, layer 3 read now
    assert _layer(cycle.get(0)) == 0  # (read ahead after 3: the cycle wraps)
    cycle.close()
    reads = [i for i, _ in store.loads]
    assert reads[:1] == [0] and 3 in reads and reads.count(0) == 2


def test_a_pending_read_ahead_is_cancelled_by_close():
    store, refs = _MemoryStore(), _refs(3)
    cycle = LayerCycle(store, refs)
    release = threading.Event()
    blocker = store.submit_read(release.wait, 10)  # (the reader thread busy: a read ahead stays queued)
    assert _layer(cycle.get(0)) == 0  # on demand, on this thread; layer 1's read queued behind the blocker
    cycle.close()  # cancels it before it runs
    release.set()
    blocker.result()
    assert [i for i, _ in store.loads] == [0] and cycle.read_bytes == store.nbytes(refs[0])


def test_a_layer_the_store_does_not_hold_is_handed_over_as_it_is():
    store, refs = _MemoryStore(), _refs(3)
    in_memory = {"w": np.full((2, 3), 1, np.float32), "b": np.zeros(3, np.float32)}
    refs[1] = in_memory
    cycle = LayerCycle(store, refs, place=lambda x: x * 1)
    assert [_layer(cycle.get(i)) for i in range(3)] == [0, 1, 2]
    assert cycle.get(1) is in_memory
    cycle.close()
    assert 1 not in [i for i, _ in store.loads]


def test_a_read_that_fails_raises_where_the_layer_is_asked_for():
    store, refs = _MemoryStore(), _refs(3)
    store.broken = {1}
    cycle = LayerCycle(store, refs)
    cycle.get(0)  # (layer 1's read ahead fails on the reader thread)
    with pytest.raises(OSError, match="layer 1: cannot read"):
        cycle.get(1)
    cycle.close()
