"""Datasets: TFDS builders (written as array_record) and the Grain input pipeline."""
