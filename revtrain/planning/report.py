"""The memory plan's words: the one-line refusal (what does not fit, by how much, and what would) and the
table of trainer choices ``revtrain plan`` prints."""

from __future__ import annotations

from revtrain.limits import gib
from revtrain.planning.memory import FLOOR_METHOD, RUNTIME_BYTES, TABLE_PARTS, MemoryPlan
from revtrain.planning.setups import store_tiers, tier_of

def short_tier(own: MemoryPlan) -> str:
    """The first tier of ``own`` that does not fit (the one its refusal names)."""
    return next(t for t in own.tiers if not own.fits_tier(t))


def refusal(own: MemoryPlan, others: list[MemoryPlan]) -> str:
    """The one-line refusal: what does not fit, by how much, its parts, and the settings that would fit."""
    tier = short_tier(own)
    parts = ", ".join(f"{k.replace('_', ' ')} {gib(v)}" for k, v in own.tiers[tier].items() if v)
    store = tier_of(own.setup)
    if tier == store.name and store.state_memory is None:  # the tier's own store is short: its own words
        held, advice = store.store_advice()
        return (f"the memory plan does not fit: {own.setup.label} {own.shortfall()} ({parts}: {held}); {advice}; "
                "train.memory_plan = False skips this check")
    if tier == "pinned" and "pool" in own.tiers["pinned"]:  # the state in XLA's pinned pool (a GPU)
        from revtrain import pinned
        need = sum(v for k, v in own.tiers["pinned"].items() if k != "pool")
        values = [cls.gin_value for cls in store_tiers() if cls.gin_value is not None]  # (the disk tier's 'disk')
        stores = (", or use " + " or ".join(f"ReversibleTrainer.offload = {v!r}" for v in values)) if values else ""
        return (f"the memory plan does not fit: {own.setup.label} {own.shortfall()} ({parts}); set "
                f"{pinned.LIMIT_ENV}={pinned.limit_gb_for(need)} (revtrain train sizes the pool from the state "
                f"alone: kept inputs and deferred buffers come on top){stores}; "
                "train.memory_plan = False skips this check")
    fitting = [p for p in others if p.fits]
    # The least that fits: a choice that adds settings to one that fits already is left out.
    fitting = [p for p in fitting if not any(q is not p and set(q.setup.settings) < set(p.setup.settings)
                                             for q in fitting)]
    if fitting:
        ways = "; ".join(f"{', '.join(p.setup.settings)} ({gib(p.total(tier) if tier in p.tiers else 0)})"
                         for p in fitting[:4])
        hint = f"these settings would fit: {ways}"
    elif own.limits.get("host") is not None and own.limits["host"] <= RUNTIME_BYTES * 5 // 4:
        # The runtime alone (imports, backend, data pipeline) takes 80% of the limit or more: no model fits.
        hint = (f"this process's runtime alone takes about {gib(RUNTIME_BYTES)}: raise the memory limit (a "
                "smaller model would not fit either)")
    else:
        hint = "none of the trainer choices fits here (revtrain plan --config ... shows them); use a smaller model"
    return (f"the memory plan does not fit: {own.setup.label} {own.shortfall()} ({parts}); {hint}; "
            "train.memory_plan = False skips this check")


def table(plans: list[MemoryPlan]) -> str:
    """A table of plans (one row per trainer choice, one column per part of each tier, GiB)."""
    tiers = list(dict.fromkeys(t for pl in plans for t in pl.tiers))
    head = ["choice"]
    for t in tiers:
        head += [f"{t}:{p}" for p in TABLE_PARTS if any(pl.tiers.get(t, {}).get(p) for pl in plans)] + [f"{t}:total"]
    head += ["fits"]
    rows = []
    for pl in plans:
        row = [pl.setup.label]
        for t in tiers:
            row += [f"{pl.tiers.get(t, {}).get(p, 0) / 2**30:.3f}" for p in TABLE_PARTS
                    if any(q.tiers.get(t, {}).get(p) for q in plans)]
            row += [f"{pl.total(t) / 2**30:.3f}" if t in pl.tiers else "-"]
        row += ["yes" if pl.fits else "no"]
        rows.append(row)
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [head] + rows]
    def limit_of(t):
        pl = next(q for q in plans if t in q.tiers)
        return (f"{t} limit {gib(pl.limits[t])} ({pl.sources[t]})" if pl.limits[t] is not None
                else f"{t} limit unknown ({pl.sources[t]})")
    limit = "; ".join(limit_of(t) for t in tiers)
    compiled = [pl for pl in plans if not pl.floor]
    note = f"temporaries: {(compiled or plans)[0].method}"
    if any(pl.floor for pl in plans):
        note += "; " + ", ".join(pl.setup.label for pl in plans if pl.floor) + f": {FLOOR_METHOD} (a lower bound)"
    return "\n".join(lines + [f"(GiB; {limit}; {note})"])
