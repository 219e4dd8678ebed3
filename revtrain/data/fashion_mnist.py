"""Fashion-MNIST (Xiao, Rasul, Vollgraf 2017) from local IDX files, as a TFDS builder, and its task.

70,000 real 28x28 greyscale product images in 10 classes: 60,000 for training ('train') and 10,000 for
testing ('test'). The source is a directory holding the four IDX files of the original release:

  train-images-idx3-ubyte.gz  train-labels-idx1-ubyte.gz  t10k-images-idx3-ubyte.gz  t10k-labels-idx1-ubyte.gz

(each also accepted uncompressed, without ``.gz``). By default that is the Debian package
``dataset-fashion-mnist`` (``apt-get install dataset-fashion-mnist``), which installs them under
``/usr/share/datasets/fashion-mnist/``. Debian re-gzipped the files, so TFDS's own ``fashion_mnist`` builder
(which checks the checksums of the original ``.gz`` downloads) does not accept them; this builder reads the
IDX contents and checks their structure (magic numbers, counts, 28x28, labels in 0..9) instead.

The prepared dataset (``array_record``, records ``{'image': uint8 [28, 28, 1], 'label': int64}``, in the
order of the IDX files) is cached under ``<data_dir>/fashion_mnist_idx/<config>/1.0.0/`` and read back with
Grain. ``FashionMNISTTask`` serves batches ``{'image': float32 [B, 28, 28, 1], 'targets': int32 [B]}``
(plus ``'weights'`` for evaluation); images are normalised with the training set's mean and standard
deviation.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import os
import pathlib
import zlib
from collections.abc import Iterator

import gin
import grain
import numpy as np
import tensorflow_datasets as tfds
from absl import logging as absl_logging

from revtrain.data.corpus import DataError, default_data_dir
from revtrain.data.task import Task

DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
DEBIAN_PACKAGE = "dataset-fashion-mnist"
CLASS_NAMES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
               "Ankle boot")
IMAGE_SHAPE = (28, 28, 1)
# split -> (images file, labels file, number of examples), file names without ".gz".
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", 60_000),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", 10_000),
}
# Mean and standard deviation of the 60,000 training images' pixels, scaled to [0, 1].
PIXEL_MEAN, PIXEL_STD = 0.2860, 0.3530
_IDX_MAGIC = {1: 2049, 3: 2051}  # unsigned bytes, 1 or 3 dimensions

# Ordered thread prefetch: deterministic, and the iterator state is the index of the next batch.
_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)


def how_to_get(directory: str) -> str:
    """One sentence saying how to provide the four IDX files."""
    if os.path.abspath(directory) == DEBIAN_DIR:
        return (f"install the Debian package with `sudo apt-get install {DEBIAN_PACKAGE}` (`make train-revnet` "
                "does it when run as root), or set FashionMNISTTask.source to a directory holding "
                + ", ".join(f"{f}.gz" for split in FILES.values() for f in split[:2]))
    return ("put " + ", ".join(f"{f}.gz" for split in FILES.values() for f in split[:2])
            + f" there (from https://github.com/zalandoresearch/fashion-mnist or the Debian package "
            f"{DEBIAN_PACKAGE}, which installs them in {DEBIAN_DIR})")


def _find(directory: pathlib.Path, name: str) -> pathlib.Path | None:
    for candidate in (directory / f"{name}.gz", directory / name):
        if candidate.is_file():
            return candidate
    return None


def missing_files(source: str) -> list[str]:
    """Names of the four IDX files (without ``.gz``) that ``source`` lacks (all four when it is no directory)."""
    directory = pathlib.Path(source).expanduser()
    names = [f for split in FILES.values() for f in split[:2]]
    if not directory.is_dir():
        return names
    return [n for n in names if _find(directory, n) is None]


def check_source(source: str) -> None:
    """Raises DataError (one line: what is missing and how to get it) unless all four files are there."""
    missing = missing_files(source)
    if missing:
        where = pathlib.Path(source).expanduser()
        what = (f"{where} does not exist" if not where.exists() else
                f"{where} is not a directory" if not where.is_dir() else
                f"{where} lacks {', '.join(missing)} (.gz or uncompressed)")
        raise DataError(f"Fashion-MNIST not found: {what}; {how_to_get(str(where))}")


def read_idx(path: str | os.PathLike, ndim: int, count: int) -> np.ndarray:
    """Reads an IDX file of unsigned bytes (gzipped when the name ends in ``.gz``).

    Args:
      path: the file.
      ndim: 3 for images, 1 for labels.
      count: the number of items the file must hold.

    Returns:
      uint8 array ``[count]`` (labels) or ``[count, rows, cols]`` (images).

    Raises:
      DataError: unreadable, truncated, wrong magic number or wrong item count.
    """
    path = pathlib.Path(path)
    try:
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise DataError(f"cannot read {path}: corrupt or truncated ({e}); reinstall or replace it") from None
    header = 4 * (1 + ndim)
    if len(data) < header:
        raise DataError(f"{path} is truncated ({len(data)} bytes); reinstall or replace it")
    magic, *dims = np.frombuffer(data[:header], ">u4").tolist()
    if magic != _IDX_MAGIC[ndim]:
        raise DataError(f"{path} is not an IDX file of {ndim}-D unsigned bytes (magic {magic:#x}, "
                        f"expected {_IDX_MAGIC[ndim]:#x})")
    if dims[0] != count:
        raise DataError(f"{path} holds {dims[0]} items, expected {count}; is it the Fashion-MNIST file?")
    size = int(np.prod(dims))
    if len(data) != header + size:
        raise DataError(f"{path} has {len(data) - header} data bytes, expected {size}; reinstall or replace it")
    return np.frombuffer(data, np.uint8, offset=header).reshape(dims)


def read_split(source: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Returns ``(images uint8 [N, 28, 28], labels uint8 [N])`` of ``split`` ('train' or 'test').

    Raises:
      DataError: missing or malformed files, images not 28x28, or labels outside 0..9.
    """
    check_source(source)
    directory = pathlib.Path(source).expanduser()
    images_name, labels_name, count = FILES[split]
    images = read_idx(_find(directory, images_name), 3, count)
    labels = read_idx(_find(directory, labels_name), 1, count)
    if images.shape[1:] != IMAGE_SHAPE[:2]:
        raise DataError(f"{_find(directory, images_name)} holds {images.shape[1]}x{images.shape[2]} images, "
                        "expected 28x28")
    if labels.max() >= len(CLASS_NAMES):
        raise DataError(f"{_find(directory, labels_name)} has label {labels.max()}, expected 0..9")
    return images, labels


def config_name(source: str) -> str:
    """Deterministic config (cache directory) name for a source directory."""
    path = os.path.abspath(os.path.expanduser(source))
    if path == DEBIAN_DIR:
        return "debian"
    return f"path_{hashlib.sha1(path.encode()).hexdigest()[:12]}"


@dataclasses.dataclass(eq=False)
class FashionMNISTConfig(tfds.core.BuilderConfig):
    """Builder config: ``source``, the directory of the four IDX files."""

    source: str = DEBIAN_DIR

    @classmethod
    def make(cls, source: str) -> FashionMNISTConfig:
        return cls(name=config_name(source), source=os.path.abspath(os.path.expanduser(source)),
                   description=f"Fashion-MNIST IDX files in {source}")


class FashionMnistIdx(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Fashion-MNIST read from local IDX files; records ``{'image': uint8 [28, 28, 1], 'label': int64}``.

    Construct with ``FashionMnistIdx(config=FashionMNISTConfig.make(source), data_dir=...)``. Splits
    'train' (60,000) and 'test' (10,000), in file order.
    """

    name = "fashion_mnist_idx"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Fashion-MNIST: 28x28 greyscale images of fashion products in 10 classes.",
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Tensor(shape=IMAGE_SHAPE, dtype=np.uint8),
                "label": tfds.features.ClassLabel(names=CLASS_NAMES),
            }),
            supervised_keys=("image", "label"),
            homepage="https://github.com/zalandoresearch/fashion-mnist",
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # local files only
        source = self.builder_config.source
        data = {split: read_split(source, split) for split in FILES}  # validate everything before writing
        return {split: self._generate_examples(*arrays) for split, arrays in data.items()}

    def _generate_examples(self, images, labels):
        for k in range(len(labels)):
            yield k, {"image": images[k][:, :, None], "label": int(labels[k])}


class _DropPreparationNoise:
    """Logging filter for TFDS's warnings about dynamic configs and not-yet-prepared folders."""

    def filter(self, record) -> bool:
        message = record.getMessage()
        return not (message.startswith("Using custom data configuration") or message.startswith("Variant folder"))


def load_fashion_mnist(source: str = DEBIAN_DIR, data_dir: str | None = None) -> tfds.core.DatasetBuilder:
    """Prepares (once; cached afterwards) and returns the Fashion-MNIST builder.

    Args:
      source: directory of the four IDX files (default: the Debian package's).
      data_dir: cache root (default ``$REVTRAIN_DATA_DIR`` or ``~/.cache/revtrain/data``).

    Raises:
      DataError: missing or malformed files (one line saying how to get them). A failed preparation leaves
        no dataset that looks complete.
    """
    data_dir = os.path.expanduser(data_dir or default_data_dir())
    config = FashionMNISTConfig.make(source)
    quiet = _DropPreparationNoise()
    absl_logging.get_absl_logger().addFilter(quiet)
    try:
        builder = FashionMnistIdx(config=config, data_dir=data_dir)
    finally:
        absl_logging.get_absl_logger().removeFilter(quiet)
    if not builder.is_prepared():
        check_source(config.source)  # a clear error before TFDS creates any directory
        builder.download_and_prepare(
            file_format="array_record",
            download_config=tfds.download.DownloadConfig(try_download_gcs=False),
        )
    return builder


def _normalise(images: np.ndarray) -> np.ndarray:
    return ((images.astype(np.float32) / 255.0 - PIXEL_MEAN) / PIXEL_STD).astype(np.float32)


def _to_batch(batch: dict) -> dict:
    return {"image": _normalise(batch["image"]), "targets": batch["label"].astype(np.int32)}


def augment_example(example: dict, rng: np.random.Generator, max_shift: int = 2) -> dict:
    """Random horizontal flip and a random translation by up to ``max_shift`` pixels (zero fill).

    Args:
      example: ``{'image': uint8 [28, 28, 1], 'label': ...}``.
      rng: the generator Grain gives each record (deterministic per record and seed).

    Returns:
      A new example with the transformed image.
    """
    image = example["image"]
    if rng.random() < 0.5:
        image = image[:, ::-1]
    if max_shift:
        dy, dx = rng.integers(-max_shift, max_shift + 1, size=2)
        padded = np.pad(image, ((max_shift, max_shift), (max_shift, max_shift), (0, 0)))
        image = padded[max_shift + dy: max_shift + dy + image.shape[0], max_shift + dx: max_shift + dx + image.shape[1]]
    return {**example, "image": np.ascontiguousarray(image)}


@gin.configurable
class FashionMNISTTask(Task):
    """10-class image classification on Fashion-MNIST; evaluation on the 'test' split.

    Args:
      source: directory with the four IDX files (default: the Debian package ``dataset-fashion-mnist``).
      augment: random horizontal flips and translations by up to ``max_shift`` pixels of training images.
      max_shift: largest translation in pixels when augmenting.
      data_dir: dataset cache (default ``$REVTRAIN_DATA_DIR`` or ``~/.cache/revtrain/data``).

    Raises:
      DataError: missing or malformed source files (one line saying how to get them).
    """

    bits_per_byte = False
    num_classes = len(CLASS_NAMES)

    def __init__(self, source: str = DEBIAN_DIR, augment: bool = False, max_shift: int = 2,
                 data_dir: str | None = None):
        if max_shift < 0 or max_shift > 8:
            raise DataError(f"FashionMNISTTask.max_shift must be in [0, 8], got {max_shift}")
        self.source = os.path.abspath(os.path.expanduser(source))
        self.augment = bool(augment)
        self.max_shift = int(max_shift)
        self.data_dir = data_dir or default_data_dir()
        self.builder = load_fashion_mnist(self.source, self.data_dir)

    @classmethod
    def config_model_kwargs(cls) -> dict:
        """``{'num_classes': 10}``: the classes are fixed."""
        return {"num_classes": cls.num_classes}

    def model_kwargs(self) -> dict:
        return {"num_classes": self.num_classes}

    def input_spec(self, batch_size: int) -> dict:
        """Shapes of a batch: ``image`` float32 ``[batch_size, 28, 28, 1]``, ``targets`` int32 ``[batch_size]``."""
        import jax
        return {"image": jax.ShapeDtypeStruct((batch_size, 28, 28, 1), np.float32),
                "targets": jax.ShapeDtypeStruct((batch_size,), np.int32)}

    def train_iterator(self, batch_size: int, seed: int, shard_index: int, shard_count: int):
        """Endless shuffled batches of this process's share: a checkpointable Grain iterator.

        Every process walks the same global order ('train' shuffled with ``seed``, reshuffled every epoch,
        augmented per global position) cut into global batches of ``batch_size * shard_count``; process
        ``shard_index`` reads only rows ``[shard_index * batch_size, (shard_index + 1) * batch_size)`` of
        each, so the global batches do not depend on the number of processes. Batches may straddle an
        epoch boundary.

        Returns:
          iterator of ``{'image': float32 [batch_size, 28, 28, 1], 'targets': int32 [batch_size]}``;
          ``get_state()`` / ``set_state()`` restore the exact position.
        """
        if not 0 <= shard_index < shard_count:
            raise ValueError(f"need 0 <= shard_index < shard_count, got {shard_index} and {shard_count}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        ds = grain.MapDataset.source(self.builder.as_data_source(split="train"))
        ds = ds.shuffle(seed=seed).repeat()
        if self.augment:
            shift = self.max_shift
            ds = ds.random_map(lambda ex, rng: augment_example(ex, rng, shift), seed=seed)
        ds = ds.batch(batch_size, drop_remainder=True)[shard_index::shard_count].map(_to_batch)
        return iter(ds.to_iter_dataset(_READ_OPTIONS))

    def eval_batches(self, split: str, batch_size: int, max_batches: int | None, shard_index: int,
                     shard_count: int) -> Iterator[dict]:
        """One in-order pass over this process's share of ``split``, padded with weight-0 rows.

        Global batches of ``batch_size * shard_count`` records in order; process ``shard_index`` reads rows
        ``[shard_index * batch_size, (shard_index + 1) * batch_size)`` of each. Every process yields
        ``ceil(N / (batch_size * shard_count))`` batches (at most ``max_batches``).

        Returns:
          iterator of ``{'image': float32 [B, 28, 28, 1], 'targets': int32 [B], 'weights': float32 [B]}``.

        Raises:
          ValueError: bad split, batch size, max_batches or shard arguments.
        """
        if not 0 <= shard_index < shard_count:
            raise ValueError(f"need 0 <= shard_index < shard_count, got {shard_index} and {shard_count}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_batches is not None and max_batches < 0:
            raise ValueError(f"max_batches must be >= 0, got {max_batches}")
        if split not in self.builder.info.splits:
            raise ValueError(f"unknown split {split!r}; have {sorted(self.builder.info.splits)}")
        source = self.builder.as_data_source(split=split)
        global_batch = batch_size * shard_count
        num_batches = -(-len(source) // global_batch)  # same on every process
        if max_batches is not None:
            num_batches = min(num_batches, max_batches)

        def batches():
            for b in range(num_batches):
                start = b * global_batch + shard_index * batch_size
                rows = list(range(min(start, len(source)), min(start + batch_size, len(source))))
                images = np.zeros((batch_size, *IMAGE_SHAPE), np.uint8)
                targets = np.zeros((batch_size,), np.int32)
                weights = np.zeros((batch_size,), np.float32)
                if rows:
                    records = source.__getitems__(rows)
                    images[: len(rows)] = np.stack([r["image"] for r in records])
                    targets[: len(rows)] = [r["label"] for r in records]
                    weights[: len(rows)] = 1.0
                yield {"image": _normalise(images), "targets": targets, "weights": weights}

        return batches()
