"""Sampling from an offloaded state: hold the weights in device memory when they fit beside the run, else stream.

Generation (`revtrain.generate`) runs every layer for every new token. An offloaded state keeps each layer's
weights outside device memory, in its tier's store (host memory, `revtrain.tiers.host_store.HostStore`; a file,
`revtrain.tiers.disk`; or a registered tier's own). So a sample can either

* **hold** the weights: bring every layer's weights once into device memory (host RAM on the CPU backend),
  4 bytes a float32 parameter, and run the fused program (`generate._fused_program`), as a state in device
  memory does; or
* **stream** them: run the layer-by-layer schedule (`generate._generate_layerwise`: the prompt, then each token,
  through one layer at a time, the key/value caches kept in memory) and bring each layer's weights when its
  program is dispatched: through the tier's own reader where it has one (`revtrain.tiers.Tier.sample_layers`;
  the disk tier's reads each file with the next read ahead), else copied as the trainer fetches them. Memory
  holds the caches and the layers in flight; every token moves the whole model's weights.

`choose` decides, from the memory plan's figures and the tier's own count of what holding adds
(`revtrain.tiers.Tier.outside_bytes`): hold when the weights, the caches and one layer's margin fit beside what
the run holds (its planned peak while training, `revtrain.planning.MemoryPlan`, else what the process holds now)
within the limit the plan uses (`limits.host_limit` on the CPU backend, the device's ``bytes_limit`` on an
accelerator); else stream. Its one line says which and why, in the tier's words (`Tier.sample_words`). Both run
the same layers' ``decode`` on the same inputs: greedy samples are equal either way (tests/test_disk_tier.py).

The same trade-off appears in FlexGen (Sheng et al. 2023), which streams weights from disk through a
layer-by-layer schedule when they do not fit; here the choice is made per sample from the plan.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from revtrain.limits import device_limit, gib, host_limit

HOLD, STREAM = "hold", "stream"
MODES = (HOLD, STREAM)


@dataclasses.dataclass(frozen=True)
class Choice:
    """How a sample reads an offloaded state's weights.

    Attributes:
      mode: `HOLD` (every layer's weights brought once into memory) or `STREAM` (each layer brought per use).
      weights: bytes of the weights held outside device memory (what holding them adds).
      need: bytes of the tier (``tier``) that holding them would take at the peak.
      limit: bytes the process may use there (None: unknown).
      line: the one log line saying which and why.
    """

    mode: str
    weights: int
    need: int
    limit: int | None
    line: str


def weight_bytes(refs: list, tier) -> int:
    """Bytes of the weights of ``refs`` (a state's ``params``) that the tier ``tier`` (a `revtrain.tiers.Tier`)
    holds outside device memory (`Tier.outside_bytes`): what holding them in device memory adds."""
    return sum(tier.outside_bytes(r) for r in refs)


def cache_bytes(model, batch_size: int, context: int) -> int:
    """Bytes of every layer's key/value cache (``Layer.init_cache``) for ``batch_size`` rows of ``context``
    positions, from shapes."""
    total = 0
    for layer in model.layers:
        for x in jax.tree.leaves(jax.eval_shape(lambda layer=layer: layer.init_cache(batch_size, context))):
            total += int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


def _device_in_use() -> int:
    try:
        return int((jax.local_devices()[0].memory_stats() or {}).get("bytes_in_use", 0))
    except Exception:  # noqa: BLE001 (a backend without memory stats)
        return 0


def choose(refs: list, model, batch_size: int, context: int, tier, plan=None, limits: dict | None = None,
           mode: str | None = None) -> Choice:
    """Whether a sample of ``batch_size`` rows holds or streams the weights of ``refs`` (see the module note).

    Args:
      refs: the state's ``params``, one entry per layer as ``tier`` holds it (its own ref, or a tree).
      model: the run's model (its layers' caches).
      batch_size: rows sampled (padded to the devices).
      context: the model's sequence length (cache positions).
      tier: the state's tier (a `revtrain.tiers.Tier`): what holding adds (`Tier.outside_bytes`), the line's
        words (`Tier.name`, `Tier.sample_words`).
      plan: the training run's `planning.MemoryPlan` (None: ``revtrain sample``, or a run without a plan:
        what the process holds now is the base).
      limits: ``{tier: (bytes or None, source)}`` instead of `revtrain.limits.host_limit` / `device_limit`.
      mode: `HOLD` or `STREAM` to force one (the line says so); None: decide.

    Returns:
      a `Choice`.

    Raises:
      ValueError: an unknown ``mode``.
    """
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    from revtrain.memory import host_resident
    weights = weight_bytes(refs, tier)
    largest = max((tier.outside_bytes(r) for r in refs), default=0)
    caches = cache_bytes(model, batch_size, context)
    device = device_limit() if limits is None else limits.get("device", (None, ""))
    if device[0] is not None:  # an accelerator: held weights live in device memory
        where, (limit, source) = "device", device
        planned = plan is not None and "device" in plan.tiers
        base = plan.total("device") if planned else _device_in_use()
    else:  # the CPU backend: device memory is host memory
        where, (limit, source) = "host", host_limit() if limits is None else limits["host"]
        planned = plan is not None and "host" in plan.tiers
        base = plan.total("host") if planned else host_resident()[0]
    what = f"the run's planned peak {gib(base)}" if planned else f"the {gib(base)} in use now"
    need = base + weights + caches + largest  # (one layer's margin: its program's temporaries)
    fits = limit is None or need <= limit
    of = f"of {gib(limit)} ({source})" if limit is not None else f"(limit unknown: {source})"
    chosen = mode or (HOLD if fits else STREAM)
    why = "as asked" if mode is not None else ("they fit" if fits else "they do not fit")
    if chosen == HOLD:
        held = "device memory" + (" (host RAM on the CPU backend)" if where == "host" else "")
        line = (f"sampling holds the {tier.name} tier's weights in {held} ({gib(weights)}), {why}: {gib(need)} "
                f"with {what} and {gib(caches)} of caches, {of}")
    else:
        origin, moved = tier.sample_words()
        moved = moved.format(gib(weights))
        line = (f"sampling streams the {tier.name} tier's weights layer by layer {origin}, {why}: holding them "
                f"({gib(weights)}) would take {where} {gib(need)} with {what} and {gib(caches)} of caches, {of}; "
                f"each token {moved}")
    return Choice(chosen, weights, need, limit, line)


def tied_fetch(model, fetch):
    """``fetch`` (layer ``i`` -> its weights, e.g. a `Tier.sample_layers` reader's ``get``) with a tied
    layer's leaves put back (`Model.merge_tied`) from the owner's weights of the same pass: each owner's weights
    are kept from its own fetch until the next (a cycle visits the owner, the embedding, before its user, the
    head), so nothing is read twice. ``fetch`` itself when the model has no ties."""
    if not model.ties:
        return fetch
    owners = {t.owner for t in model.ties}
    kept: dict = {}

    def get(i: int):
        params = fetch(i)
        if i in owners:
            kept[i] = params
        return model.merge_tied(i, params, kept) if model.ties_of(i) else params

    return get
