"""Prepares a run's data so training can read it offline, and says what it did.

  python scripts/prepare_data.py --config FILE [--config FILE ...] [--gin 'NAME = VALUE' ...] [--gin.NAME=VALUE ...]
  python scripts/prepare_data.py [--data_dir DIR] [--source gensim_enwiki|PATH] [--sequence_length N]

With ``--config`` (what ``make data CONFIG=...`` runs; the same as ``revtrain prepare --config FILE``:
`revtrain.data.prepare.prepare_config`), the data of that config's task: ``train.task`` built as
``revtrain train`` builds it (for ``configs/enwik_bpe.gin`` the corpus tokenized with its BPE, trained
first when it is not cached). Without, the byte-level dataset of ``--source``. The default source
(``gensim_enwiki``) first needs the gensim 4.4.0 wheel (which ships an English-Wikipedia dump excerpt):
downloaded into <data_dir>/downloads/ with pip when missing. Prints one line on stderr, also on a pipe:
the data prepared (how much, how long) or found in the cache. Exits with status 2 and one line on stderr
on a data or configuration error.
"""

import pathlib
import sys

try:
    import revtrain  # noqa: F401
except ImportError:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from absl import app, flags, logging  # noqa: E402

from revtrain.data import byte_lm  # noqa: E402

_DATA_DIR = flags.DEFINE_string(
    "data_dir",
    None,
    "Cache root (default: the task's data_dir, else $REVTRAIN_DATA_DIR or ~/.cache/revtrain/data).",
)
_SOURCE = flags.DEFINE_string(
    "source",
    byte_lm.GENSIM_SOURCE,
    "Without --config: 'gensim_enwiki', a file (enwik8, .zip, .bz2) or a text directory.",
)
_SEQUENCE_LENGTH = flags.DEFINE_integer("sequence_length", 128, "Without --config: targets per record (L).")
_CONFIG = flags.DEFINE_multi_string("config", [], "A run's gin file (repeatable; later files win).")
_GIN = flags.DEFINE_multi_string("gin", [], "A gin binding 'NAME = VALUE' (repeatable).")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}", exitcode=2)
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.ERROR)  # TFDS's info/warnings are noise here.
    from revtrain import cli
    try:
        if _CONFIG.value:  # revtrain prepare --config FILE: the same package code
            from revtrain.data import prepare
            cli._quiet_libraries(verbose=False)  # noqa: SLF001 (the CLI's own settings: TFDS and absl quiet)
            status = prepare.prepare_config(_CONFIG.value, _GIN.value, _DATA_DIR.value)
            if status:
                print(status, file=sys.stderr, flush=True)
            return
        data_dir = _DATA_DIR.value or byte_lm.default_data_dir()
        if _SOURCE.value == byte_lm.GENSIM_SOURCE:
            byte_lm.ensure_gensim_wheel(data_dir)
        builder = byte_lm.load_byte_lm(_SOURCE.value, _SEQUENCE_LENGTH.value, data_dir)
        print(builder.data_status, file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001 (one line, as the revtrain command prints it)
        code, line = cli._classify(e)  # noqa: SLF001
        print(f"error: {line}", file=sys.stderr)
        sys.exit(code)


def _gin_dot_flags(argv: list[str]) -> list[str]:
    """``--gin.NAME=VALUE`` (as ``revtrain train`` takes it, and ``make data GIN=...`` passes it) as
    ``--gin=NAME = VALUE``."""
    import re
    return [f"--gin={m.group(1)} = {m.group(2)}" if (m := re.fullmatch(r"--gin\.([\w.@/]+)=(.*)", a, re.S)) else a
            for a in argv]


if __name__ == "__main__":
    app.run(main, argv=_gin_dot_flags(sys.argv))
