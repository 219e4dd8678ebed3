"""The disk tier's checkpoint form: a checkpoint of a disk-tier state is hard links to its step's layer files.

A step's files are never rewritten (`revtrain.tiers.disk_store`), so a checkpoint of a disk-tier state is a
set of hard links to them (`save_links`; a copy where the file system has no hard links), the layouts and
each leaf's checksum in ``index.json`` and the small per-layer state in ``layer_state.npz``: no copy, no state
in memory, milliseconds. `revtrain.checkpoint` saves it as the Orbax item ``disk_state`` beside ``meta`` and
``data``. Restoring checks every file whole against its checksums (`load_links`).
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from revtrain.tiers.disk_format import CHECKSUM, Layout, _fsync_dir, link_or_copy, verify_file


INDEX = "index.json"


def save_links(directory: str, refs: list, layer_state: list, step: int) -> None:
    """Writes a checkpoint item of a disk-tier state into ``directory``: a hard link per layer file, the
    layouts and each file's leaf checksums (``index.json``) and the small layer state (``layer_state.npz``)."""
    os.makedirs(directory, exist_ok=True)
    index = {"step": step, "layers": []}
    for g, ref in enumerate(refs):
        name = f"layer_{g:05d}.bin"
        link_or_copy(ref.path, os.path.join(directory, name))
        index["layers"].append({"file": name, "size": ref.layout.size, "leaves": ref.layout.describe(),
                                "params_leaves": ref.layout.num_params_leaves})
        if ref.sums is not None:
            index["layers"][-1][CHECKSUM] = [f"{x:016x}" for x in ref.sums]
    arrays = {f"l{g}_{k}": np.asarray(x) for g, s in enumerate(layer_state) for k, x in enumerate(jax.tree.leaves(s))}
    with open(os.path.join(directory, "layer_state.npz"), "wb") as f:
        np.savez(f, **arrays)
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump(index, f)
    _fsync_dir(directory)


def load_links(directory: str) -> dict:
    """The item `save_links` wrote: ``{"directory", "index", "layer_state": {name: array}, "note"}``. Every
    file is checked whole against its leaves' checksums (`verify_file`: one read of the checkpoint's state); a
    checkpoint written before checksums is read unverified, and ``note`` says so (one line for the log;
    None otherwise).

    Raises:
      ValueError: the index is missing or garbled, or a file is missing or of the wrong size.
      DamagedFile: a file's bytes do not match its checksums.
    """
    with open(os.path.join(directory, INDEX)) as f:
        index = json.load(f)
    for entry in index["layers"]:
        path = os.path.join(directory, entry["file"])
        size = os.path.getsize(path)
        if size != entry["size"]:
            raise ValueError(f"{path} holds {size} bytes, its layout {entry['size']}")
    unverified = [e["file"] for e in index["layers"] if CHECKSUM not in e]
    for entry in index["layers"]:
        if CHECKSUM in entry:
            verify_file(os.path.join(directory, entry["file"]), _saved_layout(entry),
                        [int(x, 16) for x in entry[CHECKSUM]])
    note = None
    if unverified:
        note = (f"the disk-tier checkpoint at step {index.get('step')} ({directory}) has no checksums for "
                f"{len(unverified)} of its {len(index['layers'])} layer files (written before they existed): those "
                "are read unverified")
    with np.load(os.path.join(directory, "layer_state.npz")) as z:
        layer_state = {k: z[k] for k in z.files}
    return {"directory": str(directory), "index": index, "layer_state": layer_state, "note": note}


def _saved_layout(entry: dict) -> Layout:
    """The `Layout` (shapes, dtypes, offsets; no tree structures) of an ``index.json`` layer entry."""
    leaves = entry["leaves"]
    return Layout(None, None, tuple(tuple(s) for s, _, _ in leaves), tuple(np.dtype(d) for _, d, _ in leaves),
                  tuple(o for _, _, o in leaves), entry["params_leaves"], entry["size"])


def check_layout(saved: dict, layout: Layout, g: int) -> None:
    """Raises ValueError when layer ``g``'s saved layout is not ``layout`` (another model or optimizer)."""
    if saved["leaves"] != layout.describe() or saved["params_leaves"] != layout.num_params_leaves:
        raise ValueError(f"layer {g}'s file does not match the model's shapes")
