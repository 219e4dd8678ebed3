"""revtrain: memory-efficient reversible training in JAX."""

__version__ = "0.1.0"
