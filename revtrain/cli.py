"""The ``revtrain`` command line: ``train`` and ``eval`` (t5x / Trax style gin configuration).

  revtrain train --config FILE [--config FILE ...] [--gin 'NAME = VALUE' ...] [--gin.NAME=VALUE ...]
                 --workdir DIR [--verbose] [--coordinator_address HOST:PORT --num_processes N --process_id I]
  revtrain eval  --workdir DIR [--step N | --all] [--gin ...] [--verbose]

Later config files and bindings win. Usage and configuration errors exit with status 2 and one line on
stderr; other failures exit 1 with one line. ``--verbose`` shows tracebacks and library logs.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import warnings

EXIT_USAGE = 2
EXIT_FAILURE = 1


class UsageError(Exception):
    """Bad command-line usage (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="revtrain", description="Memory-efficient reversible training in JAX.")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    for name in ("train", "eval"):
        s = sub.add_parser(name)
        s.add_argument("--workdir", required=True, help="run directory")
        s.add_argument("--config", action="append", default=[], help="gin file (repeatable; later files win)")
        s.add_argument("--gin", action="append", default=[], help="gin binding 'NAME = VALUE' (repeatable)")
        s.add_argument("--verbose", action="store_true", help="tracebacks and library logs")
        s.add_argument("--coordinator_address", help="multi-host: HOST:PORT of process 0")
        s.add_argument("--num_processes", type=int, help="multi-host: number of processes")
        s.add_argument("--process_id", type=int, help="multi-host: this process's index")
        if name == "eval":
            g = s.add_mutually_exclusive_group()
            g.add_argument("--step", type=int, help="score this checkpoint step")
            g.add_argument("--all", action="store_true", help="score every kept checkpoint not yet scored")
    return p


def parse_args(argv: list[str]):
    """Parses ``argv`` (without the program name). ``--gin.NAME=VALUE`` becomes the binding ``NAME = VALUE``.

    Raises:
      UsageError: unknown arguments or a missing subcommand.
    """
    args, rest = _parser().parse_known_args(argv)
    if args.command is None:
        raise UsageError("expected a command: train or eval")
    for item in rest:
        m = re.fullmatch(r"--gin\.([\w.@/]+)=(.*)", item, re.S)
        if not m:
            raise UsageError(f"unrecognized argument: {item}")
        args.gin.append(f"{m.group(1)} = {m.group(2)}")
    return args


def _quiet_libraries(verbose: bool) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if verbose:
        return
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="tensorflow_datasets")
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.ERROR)
    import logging
    logging.getLogger("jax").setLevel(logging.ERROR)
    logging.getLogger("orbax").setLevel(logging.ERROR)
    try:
        import tensorflow_datasets as tfds
        tfds.disable_progress_bar()
    except ImportError:
        pass


def _init_distributed(args) -> None:
    import jax
    given = [args.coordinator_address, args.num_processes, args.process_id]
    if any(v is not None for v in given):
        if any(v is None for v in given):
            raise UsageError("multi-host needs all of --coordinator_address, --num_processes and --process_id")
        if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
            raise UsageError(f"--process_id {args.process_id} is not in [0, {args.num_processes})")
    elif not any(k in os.environ for k in ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri")):
        return  # single process
    if jax.config.jax_platforms in (None, "", "cpu") and "JAX_PLATFORMS" not in os.environ or \
            os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.coordinator_address:
        jax.distributed.initialize(coordinator_address=args.coordinator_address,
                                   num_processes=args.num_processes, process_id=args.process_id)
    else:
        jax.distributed.initialize()


def _gin_names() -> list[str]:
    import gin
    names = []
    for selector, configurable in gin.config._REGISTRY.items():  # noqa: SLF001 (gin has no public listing)
        names.append(selector)
        try:
            import inspect
            params = inspect.signature(configurable.wrapped).parameters
            names.extend(f"{selector}.{p}" for p in params)
        except (TypeError, ValueError):
            pass
    return names


def _gin_error_line(e: Exception) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    m = re.search(r"No configurable matching '([^']+)'", msg) or re.search(
        r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'", msg)
    if m:
        wanted = m.group(1) if m.lastindex == 1 else f"{m.group(1)}.{m.group(2)}"
        close = difflib.get_close_matches(wanted, _gin_names(), n=1, cutoff=0.6)
        if close:
            msg += f" (did you mean '{close[0]}'?)"
    return f"bad gin configuration: {msg}"


def _parse_gin(configs: list[str], bindings: list[str]) -> None:
    import gin

    from revtrain import registry  # noqa: F401  (registers the configurables)
    for path in configs:
        if not os.path.isfile(path):
            raise UsageError(f"config file not found: {path}")
    try:
        gin.parse_config_files_and_bindings(configs, bindings, finalize_config=False)
    except (ValueError, SyntaxError, TypeError, KeyError, NameError) as e:
        raise UsageError(_gin_error_line(e)) from e


def _run(args) -> int:
    import gin

    from revtrain import loop
    if args.command == "train":
        _parse_gin(args.config, args.gin)
        loop.train(args.workdir)
        return 0
    if args.command == "eval":
        config = os.path.join(args.workdir, "config.gin")
        if not os.path.isfile(config):
            raise UsageError(f"no config.gin in {args.workdir}: is it a revtrain workdir?")
        _parse_gin([config] + args.config, args.gin)
        loop.eval_checkpoints(args.workdir, step=args.step, all_steps=args.all)
        return 0
    del gin
    raise UsageError(f"unknown command {args.command}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``revtrain`` console script. Returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    verbose = "--verbose" in argv
    try:
        args = parse_args(argv)
        _quiet_libraries(verbose)
        _init_distributed(args)
        return _run(args)
    except Exception as e:  # classify: usage/config errors -> 2, anything else -> 1
        if verbose:
            raise
        code, line = _classify(e)
        print(f"revtrain: error: {line}", file=sys.stderr)
        return code


def _classify(e: Exception) -> tuple[int, str]:
    from revtrain.checkpoint import CheckpointError
    from revtrain.data.byte_lm import DataError
    from revtrain.loop import ConfigError
    from revtrain.trainers.common import TrainerError
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if isinstance(e, (UsageError, ConfigError, DataError, TrainerError, CheckpointError)):
        return EXIT_USAGE, first
    if isinstance(e, PermissionError):
        return EXIT_USAGE, f"cannot write: {first}"
    if isinstance(e, FloatingPointError):
        return EXIT_FAILURE, first
    return EXIT_FAILURE, f"{type(e).__name__}: {first} (run with --verbose for the traceback)"


if __name__ == "__main__":
    sys.exit(main())
