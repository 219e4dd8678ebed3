"""Prepares the byte-level LM dataset (TFDS, array_record) so training can read it offline.

  python scripts/prepare_data.py [--data_dir DIR] [--source gensim_enwiki|PATH]
      [--sequence_length N]

With the default source, first downloads the gensim 4.4.0 wheel (which ships an English-Wikipedia
dump excerpt) into <data_dir>/downloads/ with pip. Exits with status 2 and one line on stderr on a
data error.
"""

import pathlib
import sys

try:
    import revtrain  # noqa: F401
except ImportError:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import tensorflow_datasets as tfds  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from revtrain.data import byte_lm  # noqa: E402

_DATA_DIR = flags.DEFINE_string(
    "data_dir",
    byte_lm.default_data_dir(),
    "Cache root ($REVTRAIN_DATA_DIR or ~/.cache/revtrain/data).",
)
_SOURCE = flags.DEFINE_string(
    "source",
    byte_lm.GENSIM_SOURCE,
    "'gensim_enwiki', a file (enwik8, .zip, .bz2) or a text directory.",
)
_SEQUENCE_LENGTH = flags.DEFINE_integer("sequence_length", 128, "Targets per record (L).")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}", exitcode=2)
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.ERROR)  # TFDS's info/warnings are noise here.
    if not sys.stderr.isatty():
        tfds.disable_progress_bar()
    try:
        if _SOURCE.value == byte_lm.GENSIM_SOURCE:
            byte_lm.ensure_gensim_wheel(_DATA_DIR.value)
        builder = byte_lm.load_byte_lm(_SOURCE.value, _SEQUENCE_LENGTH.value, _DATA_DIR.value)
    except byte_lm.DataError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    split_bytes = builder.info.metadata["split_bytes"]
    print(builder.data_dir)
    for split in byte_lm.SPLITS:
        print(
            f"{split:<10} {builder.info.splits[split].num_examples:>9,} records "
            f"{split_bytes[split]:>12,} bytes"
        )


if __name__ == "__main__":
    app.run(main)
