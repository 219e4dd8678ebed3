"""Layers: the layer protocol (standard, reversible, head) and the model families' building blocks."""

from revtrain.layers.base import HeadLayer, Layer, ReversibleLayer, dropout, snap_to_grid, split_keys

__all__ = ["Layer", "ReversibleLayer", "HeadLayer", "dropout", "snap_to_grid", "split_keys"]
