"""A tier's sampling form for a store that reads on its own thread (files: the disk tier's, a registered
tier's): each layer's weights read as generation reaches it, the next layer read ahead (`LayerCycle`).

Generation (`revtrain.generate`) visits the layers in a cycle, ``0 .. L-1`` for every token, so the layer after
the one computing is always known: reading it on the store's reader thread while the one before computes hides
the read behind the compute when the store reads faster than the layer runs (FlexGen, Sheng et al. 2023,
overlaps its disk reads with compute the same way). `revtrain.tiers.base.Tier.sample_layers` hands this reader
to `revtrain.generate` for any tier whose store is threaded (`revtrain.streaming.Store.threaded`); generate
never names the tier.
"""

from __future__ import annotations


class LayerCycle:
    """Layer ``i``'s weights placed (``place``: e.g. `placement.placer`), for layers visited in a cycle
    ``0 .. L-1, 0 ..`` (every token of a layer-by-layer generation): each `get` hands over layer ``i`` and
    starts reading layer ``(i + 1) % L`` on the store's reader thread (`Store.load`, then `Store.read` with
    ``place``), so one layer is read while the one before it computes. A layer the store does not hold (one in
    memory) is returned as it is. The store's refs are only read, never written.

    Args:
      store: a threaded `revtrain.streaming.Store` (its ``submit_read``, ``holds``, ``load``, ``read``,
        ``nbytes``).
      refs: one entry per layer, the store's ref or a tree of arrays.
      place: numpy leaf -> placed array (None: the numpy leaves as they are).

    Attributes:
      read_bytes: bytes of weights read from the store so far.

    Raises (from `get`):
      OSError: the store cannot read a layer (e.g. `revtrain.tiers.disk_format.DiskTierError`: a file is
        missing, short, unreadable or damaged).
    """

    def __init__(self, store, refs: list, place=None):
        self.store, self.refs = store, list(refs)
        self.place = place if place is not None else (lambda x: x)
        self._ahead = None  # (layer, Future of its placed weights)
        self.read_bytes = 0

    def _read(self, i: int):
        ref = self.refs[i]
        if not self.store.holds(ref):
            return ref
        item = [(ref, "params")]
        [tree] = self.store.read(item, self.place, [self.store.load(ref, "params")])
        self.read_bytes += self.store.nbytes(ref, "params")
        return tree

    def get(self, i: int):
        """Layer ``i``'s weights (read ahead when ``i`` was expected, else read now)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == i:
            tree = ahead[1].result()
        else:
            if ahead is not None and not ahead[1].cancel():
                ahead[1].result()  # (an unexpected order: the read in progress finishes, then is dropped)
            tree = self._read(i)
        nxt = (i + 1) % len(self.refs)
        self._ahead = (nxt, self.store.submit_read(self._read, nxt))
        return tree

    def close(self) -> None:
        """Waits for (or cancels) the read ahead and drops it."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and not ahead[1].cancel():
            ahead[1].exception()
