"""The disk tier's checkpoint form: a checkpoint of a disk-tier state is hard links to its step's layer files.

A step's files are never rewritten (`revtrain.tiers.disk_store`), so a checkpoint of a disk-tier state is a
set of hard links to them (`save_links`; a copy where the file system has no hard links), the layouts and
each leaf's checksum in ``index.json`` and the small per-layer state in ``layer_state.npz``: no copy, no state
in memory, milliseconds. `revtrain.checkpoint` saves it as the Orbax item ``disk_state`` (`ITEM`) beside
``meta`` and ``data``, through this module's handler (`LinksHandler`, which the disk tier names:
`revtrain.tiers.disk.DiskTier.checkpoint_handler`). Restoring checks every file whole against its checksums
(`load_links`) and gives layer files, or arrays for a template of another tier (`restore_state`).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from revtrain import metrics as metrics_lib
from revtrain.tiers.disk_format import CHECKSUM, DiskLayer, Layout, _fsync_dir, link_or_copy, read_tree, verify_file


INDEX = "index.json"
ITEM = "disk_state"  # the Orbax item of a checkpoint of a disk-tier state


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


class LinksHandler(ocp.CheckpointHandler):
    """The Orbax handler of the `ITEM` item: a disk-tier state as hard links to its layer files (`save_links`,
    `load_links`; the restore logs `load_links`'s note)."""

    def save(self, directory, args=None):
        """Writes `save_links`'s item of ``args`` (a `LinksSave`) into ``directory``."""
        save_links(str(directory), args.refs, args.layer_state, args.step)

    def restore(self, directory, args=None):
        """`load_links` of ``directory``, its note logged."""
        item = load_links(str(directory))
        if item["note"]:
            metrics_lib.log(item["note"])
        return item

    def metadata(self, directory):
        """None: the item's metadata is its ``index.json``."""
        return None

    def finalize(self, directory):
        """Nothing: `save_links` synced the directory."""

    def close(self):
        """Nothing to release."""


@ocp.args.register_with_handler(LinksHandler, for_save=True)
@dataclasses.dataclass
class LinksSave(ocp.args.CheckpointArgs):
    """Saves a disk-tier state: its layers' `DiskLayer` refs, the layer states and the step."""

    refs: list
    layer_state: list
    step: int


@ocp.args.register_with_handler(LinksHandler, for_restore=True)
@dataclasses.dataclass
class LinksRestore(ocp.args.CheckpointArgs):
    """Restores a disk-tier state's item (the files stay where they are)."""


def weights_shapes(layout: Layout):
    """The params tree of a `Layout` as ``jax.ShapeDtypeStruct`` leaves."""
    leaves = [jax.ShapeDtypeStruct(layout.shapes[i], layout.dtypes[i]) for i in layout.region("params")]
    return jax.tree.unflatten(layout.params_def, leaves)


def _placed(tree, template):
    """Numpy ``tree`` placed as ``template``'s leaves are (their shardings; as it is without one)."""
    def one(x, t):
        sharding = getattr(t, "sharding", None)
        return jax.device_put(x, sharding) if sharding is not None else x
    return jax.tree.map(one, tree, template)


def restore_state(saved: dict, template, optimizer_state: bool = True, files: bool = False):
    """The `revtrain.trainers.common.TrainState` of a restored `ITEM` ``saved`` (`load_links`'s dict) in
    ``template``'s form (a `TrainState` restore template; its
    ``step`` kept: the caller sets the checkpoint's): for a disk-tier template (its layers `DiskLayer`) the
    checkpoint's files (``optimizer_state=False``: the weights' files with ``files``, else the weights read as
    numpy; the optimizer state not read), else read layer by layer into the template's placements.

    Raises:
      ValueError: another number of layers, or a layer's file does not match the template's shapes.
      OSError: a file is missing or short (`revtrain.tiers.disk_format.DiskTierError`).
    """
    held_params, held_opt = template.held()[0], template.held()[1]
    n = len(held_params)
    entries = saved["index"]["layers"]
    if len(entries) != n:
        raise ValueError(f"{len(entries)} layer files for a model of {n} layers")
    params, opt_state, layer_state = [], [], []
    for g in range(n):
        p_t, o_t = held_params[g], held_opt[g]
        on_file = isinstance(p_t, DiskLayer)
        layout = p_t.layout if on_file else Layout.of(p_t, o_t if o_t is not None else ())
        if on_file or o_t is not None:
            check_layout(entries[g], layout, g)
        path = os.path.join(saved["directory"], entries[g]["file"])
        sums = entries[g].get(CHECKSUM)  # (carried on, so later reads are checked too)
        ref = DiskLayer(layout, path, None if sums is None else tuple(int(x, 16) for x in sums))
        if on_file and (optimizer_state or files):
            params.append(ref)
            opt_state.append(ref if optimizer_state else None)
        elif not optimizer_state:
            params.append(read_tree(path, layout, "params", sums=ref.sums))
            opt_state.append(None)
        else:
            params.append(_placed(read_tree(path, layout, "params", sums=ref.sums), p_t))
            opt_state.append(_placed(read_tree(path, layout, "opt", sums=ref.sums), o_t))
        s_t = template.layer_state[g]
        leaves = [saved["layer_state"][f"l{g}_{k}"] for k in range(len(jax.tree.leaves(s_t)))]
        layer_state.append(_placed(jax.tree.unflatten(jax.tree.structure(s_t), leaves), s_t))
    return type(template)(template.step, params, opt_state, layer_state)
