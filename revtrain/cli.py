"""The ``revtrain`` command line: ``train``, ``eval``, ``sample``, ``check``, ``export``, ``plan``, ``prepare`` and
``configs`` (t5x / Trax style gin configuration).

  revtrain train --config FILE [--config FILE ...] [--gin 'NAME = VALUE' ...] [--gin.NAME=VALUE ...]
                 --workdir DIR [--verbose] [--coordinator_address HOST:PORT --num_processes N --process_id I]
                 [--heartbeat_timeout SECONDS]
  revtrain eval  --workdir DIR [--config FILE ...] [--step N | --all] [--split {validation,test}] [--name NAME]
                 [--gin ...] [--verbose]
  revtrain sample --workdir DIR [--config FILE ...] [--step N] [--prompt TEXT | --prompt_file FILE] [--length N]
                  [--temperature T] [--top_k K] [--top_p P] [--num_samples K] [--seed S] [--output FILE] [--gin ...]
  revtrain check --config FILE [--config FILE ...] [--gin ...]   (exit 0: exact within tolerance, 1: not)
  revtrain check --workdir DIR [--config FILE ...] [--step N] [--gin ...]   (the same, on a run's checkpoint)
  revtrain export --workdir DIR [--config FILE ...] [--step N] --to OUT [--dtype {float32,bfloat16}] [--gin ...]
                  (a Llama run as a Hugging Face checkpoint directory: config.json + model.safetensors)
  revtrain plan  --config FILE [--config FILE ...] [--gin ...]   (the memory plan of each trainer choice, and
                 whether it fits here; trains nothing)
  revtrain prepare --config FILE [--config FILE ...] [--gin ...] [--data_dir DIR]   (the config's data, fetched
                   and prepared as `make data` does; one line)
  revtrain configs   (the configs shipped with revtrain: name, model, parameters, what it is for)

--config FILE is a path, or the name of a shipped config (enwik_modern.gin; `revtrain configs` lists them).
train, eval, sample, check, export and plan prepare missing data themselves (the default corpus fetched with
pip), saying so in one line.

With --workdir, the run's DIR/config.gin comes first, then the --config files, then the --gin bindings.
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

from revtrain.errors import EXIT_FAILURE, EXIT_USAGE, UsageError, exit_status  # noqa: F401  (cli.UsageError)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    synopsis = __doc__.split("\n\n", 1)[1].split("\nLater config files", 1)[0]
    p = _Parser(prog="revtrain", description="Memory-efficient reversible training in JAX.",
                epilog="commands:\n" + synopsis + "\n\nrevtrain COMMAND --help: the options of one command; "
                       "docs/cli.md: the reference.", formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    for name in ("train", "eval", "check", "sample", "export", "plan", "prepare"):
        s = sub.add_parser(name)
        if name not in ("plan", "prepare"):
            s.add_argument("--workdir", required=name != "check", help="run directory")
        s.add_argument("--config", action="append", default=[],
                       help="gin file or shipped config name (repeatable; later files win)"
                       if name in ("train", "check", "plan", "prepare") else
                       "gin file read after the run's DIR/config.gin (repeatable; later files win)")
        s.add_argument("--gin", action="append", default=[], help="gin binding 'NAME = VALUE' (repeatable)")
        s.add_argument("--verbose", action="store_true", help="tracebacks and library logs")
        s.add_argument("--coordinator_address", help="multi-host: HOST:PORT of process 0")
        s.add_argument("--num_processes", type=int, help="multi-host: number of processes")
        s.add_argument("--process_id", type=int, help="multi-host: this process's index")
        s.add_argument("--heartbeat_timeout", type=int, default=None,
                       help="multi-host: seconds after which a silent process counts as lost (default 100)")
        if name == "prepare":
            s.add_argument("--data_dir", help="cache root to prepare into (default: the task's data_dir, else "
                                              "$REVTRAIN_DATA_DIR or ~/.cache/revtrain/data)")
        if name == "eval":
            g = s.add_mutually_exclusive_group()
            g.add_argument("--step", type=int, help="score this checkpoint step")
            g.add_argument("--all", action="store_true", help="score every kept checkpoint not yet scored")
            s.add_argument("--split", choices=("validation", "test"), help="split to score (default: evaluate.split)")
            s.add_argument("--name", help="write the scores to metrics/eval_NAME.jsonl (eval_NAME_test.jsonl for "
                                          "--split test when the run evaluates validation; TensorBoard the same "
                                          "prefix) instead of the split's file: other data scored with --gin keeps "
                                          "the run's own records")
        if name == "sample":
            _sample_arguments(s)
        if name == "check":
            s.add_argument("--step", type=int, help="with --workdir: check this checkpoint step (default: newest)")
        if name == "export":
            s.add_argument("--step", type=int, help="export this checkpoint step (default: newest)")
            s.add_argument("--to", required=True, help="the Hugging Face checkpoint directory to write")
            s.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                           help="dtype of the written tensors (default float32)")
    s = sub.add_parser("configs")
    s.add_argument("--verbose", action="store_true", help="tracebacks and library logs")
    s.set_defaults(config=[], gin=[], coordinator_address=None, num_processes=None, process_id=None,
                   heartbeat_timeout=None)
    return p


def _sample_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--step", type=int, help="sample from this checkpoint step (default: newest)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--prompt", help="prompt text (default: one newline)")
    g.add_argument("--prompt_file", help="file whose bytes are the prompt")
    s.add_argument("--length", type=int, default=256, help="bytes to generate; tokens for a run with a tokenizer (default 256)")
    s.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default 1.0)")
    s.add_argument("--top_k", type=int, default=0, help="keep the K most likely tokens (bytes for a byte-level run; default 0: off)")
    s.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1: off)")
    s.add_argument("--num_samples", type=int, default=1, help="samples (default 1)")
    s.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    s.add_argument("--output", help="write raw bytes to FILE (FILE.0, FILE.1, ... for several samples)")


def parse_args(argv: list[str]):
    """Parses ``argv`` (without the program name). ``--gin.NAME=VALUE`` becomes the binding ``NAME = VALUE``.

    Raises:
      UsageError: unknown arguments or a missing subcommand.
    """
    args, rest = _parser().parse_known_args(argv)
    if args.command is None:
        raise UsageError("expected a command: train, eval, check, sample, export, plan, prepare or configs")
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
    # XLA's C++ log lines (e.g. the "Very slow compile?" alarm, logged at ERROR) obey the level jaxlib's
    # absl logging is given: jax sets it from ``jax_logging_level``, whose default is the "jax" Python
    # logger's level when jax is first imported (ERROR below, which would let those lines through) and
    # which overrides TF_CPP_MIN_LOG_LEVEL. CRITICAL maps to the C++ level FATAL; it applies at once, also
    # after the backend started.
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import jax
    jax.config.update("jax_logging_level", "CRITICAL")
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="tensorflow_datasets")
    from absl import logging as absl_logging
    # FATAL, not ERROR: Orbax logs a failed asynchronous save (e.g. disk full) as several ERROR records with
    # tracebacks from its threads; revtrain reports that failure itself, in one line.
    absl_logging.set_verbosity(absl_logging.FATAL)
    _drop_library_thread_write_errors()
    import logging
    logging.getLogger("jax").setLevel(logging.ERROR)
    logging.getLogger("orbax").setLevel(logging.ERROR)
    # Orbax's write tasks that fail together after one failed write (disk full) end up as asyncio's
    # "Task exception was never retrieved" records; revtrain reports the failure itself.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    try:
        import tensorflow_datasets as tfds
        tfds.disable_progress_bar()
    except ImportError:
        pass


def _drop_library_thread_write_errors() -> None:
    """Keeps a failed write (disk full, quota, read-only file system) to revtrain's one error line.

    Library threads that write files (tensorboardX's event writer, Orbax's savers) report such an
    ``OSError`` through ``threading.excepthook`` / ``sys.unraisablehook`` (and tensorboardX retries at
    exit); the main thread meets the same error and reports it once. Other exceptions still print.
    """
    import errno
    import threading
    quiet = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO)
    if getattr(threading.excepthook, "_revtrain", False):
        return
    previous_thread, previous_unraisable = threading.excepthook, sys.unraisablehook

    def thread_hook(args):
        if not (isinstance(args.exc_value, OSError) and args.exc_value.errno in quiet):
            previous_thread(args)

    def unraisable_hook(unraisable):
        if not (isinstance(unraisable.exc_value, OSError) and unraisable.exc_value.errno in quiet):
            previous_unraisable(unraisable)

    thread_hook._revtrain = True
    threading.excepthook, sys.unraisablehook = thread_hook, unraisable_hook


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{name} must be an integer, got {value!r}") from None


def _cluster_from_env() -> str | None:
    """Which multi-process launcher started this process, judged from the environment only.

    Mirrors the lightweight checks of JAX 0.10.2's own cluster detection (``jax/_src/clusters``) and
    only reports a launcher that started more than one process:

    * ``"jax"``: ``JAX_COORDINATOR_ADDRESS`` is set;
    * ``"slurm"``: ``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``, ``SLURM_NTASKS``, ``SLURM_PROCID`` and
      ``SLURM_LOCALID`` are set (an ``srun`` step) and ``SLURM_NTASKS > 1``;
    * ``"ompi"``: ``OMPI_MCA_orte_hnp_uri`` is set (``mpirun``) and ``OMPI_COMM_WORLD_SIZE > 1``.

    Cloud TPU VMs and Kubernetes are not auto-detected (JAX's checks for them query a metadata server or
    need the ``kubernetes`` package): pass the flags or ``JAX_COORDINATOR_ADDRESS`` there.
    """
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return "jax"
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(k in os.environ for k in slurm) and (_env_int("SLURM_NTASKS") or 1) > 1:
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in os.environ and (_env_int("OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return "ompi"
    return None


def _platform_is_cpu() -> bool:
    """True when JAX will compute on the CPU, decided without starting any backend.

    ``JAX_PLATFORMS`` (``jax_platforms``), when set, names the platform (its first entry wins); otherwise
    the platform is the CPU unless an accelerator plugin is installed (a ``jax_plugins`` package or entry
    point, e.g. ``jax-cuda12-plugin``, or ``libtpu``), which is what JAX itself looks for.
    """
    import importlib.util
    import pkgutil
    from importlib.metadata import entry_points

    import jax
    platforms = jax.config.jax_platforms
    if platforms:
        return platforms.split(",")[0].strip().lower() == "cpu"
    if importlib.util.find_spec("libtpu") is not None or list(entry_points(group="jax_plugins")):
        return False
    spec = importlib.util.find_spec("jax_plugins")
    return spec is None or not any(pkgutil.iter_modules(spec.submodule_search_locations or []))


def _init_distributed(args) -> None:
    """Joins a multi-process (multi-host) run when asked to; a plain single-process run otherwise.

    Multi-process is asked for in one of two ways:

    * the flags ``--coordinator_address HOST:PORT --num_processes N --process_id I`` (all three; they win
      over the environment): ``jax.distributed.initialize(HOST:PORT, N, I)``;
    * the environment (see `_cluster_from_env`). With ``JAX_COORDINATOR_ADDRESS``, revtrain also reads
      ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` and passes them on: JAX 0.10.2 itself reads only
      ``JAX_COORDINATOR_ADDRESS`` (and ``JAX_COORDINATOR_PORT``, ``JAX_COORDINATOR_BIND_ADDRESS``,
      ``JAX_LOCAL_DEVICE_IDS``) and takes the process count and index from a detected cluster. Under
      SLURM (``srun``) or Open MPI (``mpirun``), ``jax.distributed.initialize()`` is called with no
      arguments and JAX's own detection finds the coordinator (the first node; port from the job id or
      ``JAX_COORDINATOR_PORT``), the count (``SLURM_NTASKS`` / ``OMPI_COMM_WORLD_SIZE``) and the index
      (``SLURM_PROCID`` / ``OMPI_COMM_WORLD_RANK``); note that JAX then also makes only the device
      numbered by the local rank (``SLURM_LOCALID`` / ``OMPI_COMM_WORLD_LOCAL_RANK``) visible: one
      process per GPU.

    A lost process is reported by `revtrain.lifecycle.lost_peer` (one line, exit 1); ``--heartbeat_timeout`` sets
    how long a silent process may go unnoticed (JAX's ``heartbeat_timeout_seconds``, default 100).

    On the CPU platform (no accelerator), cross-process collectives use gloo over TCP
    (``jax_cpu_collectives_implementation = "gloo"``, unless ``JAX_CPU_COLLECTIVES_IMPLEMENTATION`` chose
    another). This must happen before any JAX backend starts, so it is the first JAX call of a command.

    Raises:
      UsageError: some but not all of the flags, a bad process index, a bad environment, or JAX backends
        already started.
      RuntimeError: the coordinator could not be reached (one line naming the address).
    """
    given = [args.coordinator_address, args.num_processes, args.process_id]
    kwargs: dict = {}
    if any(v is not None for v in given):
        if any(v is None for v in given):
            raise UsageError("multi-host needs all of --coordinator_address, --num_processes and --process_id")
        if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
            raise UsageError(f"--process_id {args.process_id} is not in [0, {args.num_processes})")
        if not re.fullmatch(r".+:\d+", args.coordinator_address):
            raise UsageError(f"--coordinator_address must be HOST:PORT, got {args.coordinator_address!r}")
        kwargs = {"coordinator_address": args.coordinator_address, "num_processes": args.num_processes,
                  "process_id": args.process_id}
        where = f"{args.coordinator_address} as process {args.process_id} of {args.num_processes}"
    else:
        cluster = _cluster_from_env()
        if cluster is None:
            if any(os.environ.get(k) for k in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID")):
                raise UsageError("JAX_NUM_PROCESSES / JAX_PROCESS_ID need JAX_COORDINATOR_ADDRESS")
            return  # single process
        if cluster == "jax":
            n, i = _env_int("JAX_NUM_PROCESSES"), _env_int("JAX_PROCESS_ID")
            if n is not None and n < 1:
                raise UsageError(f"JAX_NUM_PROCESSES must be positive, got {n}")
            if n is not None and i is not None and not 0 <= i < n:
                raise UsageError(f"JAX_PROCESS_ID {i} is not in [0, {n})")
            kwargs = {k: v for k, v in (("num_processes", n), ("process_id", i)) if v is not None}
        where = f"{os.environ.get('JAX_COORDINATOR_ADDRESS') or 'the coordinator'} (from the {cluster} environment)"

    from revtrain.lifecycle import lost_peer
    timeout = lost_peer.DEFAULT_HEARTBEAT_TIMEOUT if args.heartbeat_timeout is None else args.heartbeat_timeout
    if timeout < 1:
        raise UsageError(f"--heartbeat_timeout must be a positive number of seconds, got {timeout}")
    import jax
    started = "JAX backends were started before jax.distributed.initialize"
    if lost_peer.backends_started():  # too late for gloo and for jax.distributed (None: JAX will say)
        raise UsageError(started)
    if _platform_is_cpu() and not os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        lost_peer.initialize(heartbeat_timeout=timeout, **kwargs)
    except RuntimeError as e:
        if "must be called before" not in str(e):  # JAX's own word for `started`; else as below
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise RuntimeError(f"cannot join the multi-host run at {where}: {first}") from e
        raise UsageError(started) from e
    except ValueError as e:  # JAX found no process count / index / coordinator in the environment
        raise UsageError(f"cannot start multi-host from {where}: {str(e).strip()} (set JAX_NUM_PROCESSES and "
                         "JAX_PROCESS_ID, or pass --coordinator_address, --num_processes and --process_id)") from e
    except Exception as e:  # noqa: BLE001 (XlaRuntimeError and friends: coordinator unreachable, timeout)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise RuntimeError(f"cannot join the multi-host run at {where}: {first}") from e


def run_config(workdir: str, error: type[Exception] = UsageError) -> str:
    """`ginconfig.workdir_config`: the path of ``workdir/config.gin``, else ``error`` (one line)."""
    from revtrain import ginconfig
    return ginconfig.workdir_config(workdir, error)


def _parse_gin(configs: list[str], bindings: list[str], workdir: str | None = None) -> None:
    """`registry.parse_gin`; the registry (every model, layer and trainer) is imported here, on a command's
    first parse, not with this module."""
    from revtrain import registry
    registry.parse_gin(configs, bindings, workdir)


def _macro_defined(binding: str) -> str | None:
    """The macro a command-line binding defines (``'STEPS = 5'`` -> ``'STEPS'``), else None."""
    m = re.match(r"\s*([A-Za-z_]\w*)\s*=", binding)
    return m.group(1) if m and not binding.lstrip().startswith(m.group(1) + "==") else None


def _check_macros_used(bindings: list[str]) -> None:
    """Refuses a ``--gin 'NAME = VALUE'`` macro that no binding uses (``%NAME``): gin takes any name as a
    macro, so a misspelled one (``STEP = 5`` for ``STEPS``) would otherwise be ignored without a word.

    Raises:
      UsageError: one line naming the macro and the nearest macro that is used.
    """
    import gin

    defined = [m for m in (_macro_defined(b) for b in bindings) if m]
    if not defined:
        return
    used: set[str] = set()

    def walk(value) -> None:
        if isinstance(value, gin.config.ConfigurableReference):
            if value.selector == "gin.macro":
                used.add(value.scoped_selector.rsplit("/", 1)[0])
            return
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple, set)):
            for v in value:
                walk(v)

    for params in gin.config._CONFIG.values():  # noqa: SLF001 (gin has no public listing of bindings)
        walk(params)
    for name in defined:
        if name not in used:
            close = difflib.get_close_matches(name, sorted(used), n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise UsageError(f"bad gin configuration: macro {name} is set but no binding uses %{name}{hint}")


def _run(args) -> int:
    """Runs the parsed command (its ``_<command>_command``); returns the exit status.

    Raises:
      UsageError: an unknown command, or flags the command refuses.
    """
    command = _COMMANDS.get(args.command)
    if command is None:
        raise UsageError(f"unknown command {args.command}")
    from revtrain.data import corpus
    with corpus.fetching(_prepare_command(args)):  # missing data of a known source: fetched, one line
        return command(args)


def _prepare_command(args) -> str:
    """The ``revtrain prepare`` command that prepares the data of the run ``args`` names (its config files; a
    workdir's ``config.gin`` first), for the line of a fetch that failed."""
    import shlex

    from revtrain.data import corpus
    workdir = getattr(args, "workdir", None)
    configs = ([os.path.join(workdir, "config.gin")] if workdir and args.command != "train" else []) + list(args.config)
    if not configs or args.command in ("prepare", "configs"):
        return corpus.PREPARE_COMMAND
    return "revtrain prepare " + " ".join(f"--config {shlex.quote(c)}" for c in configs)


def _train_command(args) -> int:
    from revtrain import loop
    if not args.config:
        raise UsageError("train needs --config FILE (the experiment's gin file; a run's own config is "
                         "DIR/config.gin)")
    _parse_gin(args.config, args.gin)
    _check_macros_used(args.gin)
    _size_pinned_pool(args.workdir)
    loop.train(args.workdir)
    return 0


def _pinned_need(workdir: str | None = None) -> int | None:
    """Bytes of pinned host memory the configured run's host tier needs, from shapes alone and before JAX's
    backend starts, or None when the run has no host tier (or its configuration does not build: the run's own
    build then says why). The state (each layer's weights and ``jax.eval_shape`` of its optimizer state, the
    model built under ``jax.eval_shape``, which starts no backend) and one layer being written back, for one
    device: the kept inputs and the deferred update's buffers need the trainer (and the device count needs the
    backend), so the memory plan counts them after the start and refuses a pool they overflow."""
    import gin
    import jax
    import numpy as np
    from revtrain import tiers
    try:
        if not tiers.lookup(gin.query_parameter("ReversibleTrainer.offload")).host_pool:
            return None
    except ValueError:  # not bound (the device tier), or no such tier (the trainer's build says so)
        return None
    from revtrain import run as run_lib
    try:
        cfg = run_lib.TrainConfig()
        if "Reversible" not in getattr(cfg.trainer, "__name__", str(cfg.trainer)):
            return None
        task = run_lib.build_task(cfg, workdir)  # (the run's own task: its kept tokenizer, if any)
        box = []
        jax.eval_shape(lambda: box.append(cfg.model(seed=cfg.seed, **run_lib._model_kwargs(cfg, task))
                                          .param_shapes()) or ())
        tx, _ = run_lib.build_optimizer(cfg)
    except Exception:  # noqa: BLE001 (the run's build reports a bad configuration in its own words)
        return None
    nbytes = lambda tree: sum(int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
                              for x in jax.tree.leaves(tree))
    layers = [nbytes(p) + nbytes(jax.eval_shape(tx.init, p)) for p in box[0]]
    return sum(layers) + max(layers)


def _size_pinned_pool(workdir: str | None = None) -> None:
    """On a backend that may be a GPU, before it starts: XLA's pinned host pool preallocated at the size the
    host tier's state needs (`revtrain.pinned.train_environment`; each variable only where the user has not
    set it), so the state is pinned memory allocated once instead of a pool grown to up to twice its size.
    Nothing once the backends run (too late: XLA reads the variables when it makes the GPU client), on a CPU-
    or TPU-only configuration, or without a host tier.

    Raises:
      ConfigError: the user's own ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` is below the state (one line).
    """
    import jax

    from revtrain import pinned
    from revtrain.errors import ConfigError
    from revtrain.lifecycle import lost_peer
    platforms = [p.strip() for p in (jax.config.jax_platforms or "").split(",") if p.strip()]
    if platforms and not any(p in ("cuda", "gpu", "rocm") for p in platforms):
        return
    if lost_peer.backends_started() is not False:
        return
    need = _pinned_need(workdir)
    if need is None:
        return
    _, refusal = pinned.train_environment(need)
    if refusal:
        raise ConfigError(refusal)


def _eval_command(args) -> int:
    import gin

    from revtrain import loop
    config = run_config(args.workdir)
    _parse_gin([config] + args.config, args.gin, workdir=args.workdir)
    _check_macros_used(args.gin)
    kind = "eval"
    if args.split:  # scores of another split than the run's own go to metrics/eval_<split>.jsonl
        try:
            run_split = gin.query_parameter("evaluate.split")
        except ValueError:  # not bound: EvalConfig's default
            run_split = loop.EvalConfig.split
        kind = loop.eval_kind(args.split, run_split)
        gin.bind_parameter("evaluate.split", args.split)
    if args.name is not None:
        if not re.fullmatch(r"[A-Za-z0-9_-]+", args.name):
            raise UsageError(f"--name must be letters, digits, '_' or '-', got {args.name!r}")
        if re.fullmatch(r"(.*_)?(validation|test)", args.name):
            raise UsageError(f"--name {args.name!r} would share a split's file; choose a name that is not a "
                             "split and does not end in _validation or _test")
        kind = kind.replace("eval", f"eval_{args.name}", 1)  # eval_NAME, or eval_NAME_<split> for another split
    loop.eval_checkpoints(args.workdir, step=args.step, all_steps=args.all, kind=kind)
    return 0


def _sample_command(args) -> int:
    from revtrain import sample
    opts = sample.Options(length=args.length, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, num_samples=args.num_samples, seed=args.seed)
    opts.check()  # flags and prompt first: bad input writes nothing and loads nothing
    prompt = sample.read_prompt(args.prompt, args.prompt_file)
    sample.output_paths(args.output, args.num_samples)
    config = run_config(args.workdir)
    _parse_gin([config] + args.config, args.gin, workdir=args.workdir)
    _check_macros_used(args.gin)
    sample.sample_checkpoint(args.workdir, prompt, opts, step=args.step, output=args.output)
    return 0


def _check_command(args) -> int:
    from revtrain import check  # noqa: F401  (registers check.*)
    from revtrain.lifecycle import workdir as workdir_lib
    configs = list(args.config)
    if args.workdir is not None:
        configs.insert(0, run_config(args.workdir))
    elif not configs:
        raise UsageError("check needs --config FILE (a model to check) or --workdir DIR (a run's checkpoint)")
    elif args.step is not None:
        raise UsageError("--step needs --workdir")
    _parse_gin(configs, args.gin, workdir=args.workdir)
    _check_macros_used(args.gin)
    if args.workdir is None:
        return check.run_check()
    with workdir_lib.locked(args.workdir, "check"):
        return check.run_check(workdir=args.workdir, step=args.step)


def _plan_command(args) -> int:
    from revtrain import run as run_lib
    if not args.config:
        raise UsageError("plan needs --config FILE (the experiment's gin file)")
    _parse_gin(args.config, args.gin)
    _check_macros_used(args.gin)
    _size_pinned_pool()  # XLA's pinned pool sized as `train` sizes it, before the backend starts (the plan's limit)
    from revtrain import planning
    run = run_lib.build()
    budget = planning.plan_budget(run)  # a memory budget's plan, as `train` makes it (its refusal too)
    if budget is not None:
        print(budget.line())
    plans = planning.choices(run, with_standard=True)
    print(plans[0].line(optimizer=planning.optimizer_text(run.cfg)))
    memory_line = run.trainer.residency.memory_line  # the host tier's: where its state lives
    if memory_line:  # (the line `train` logs, with the pinned pool's variables it set)
        print(memory_line)
    print(planning.table(plans))
    return 0


def _prepare_data_command(args) -> int:
    from revtrain.data import prepare
    if not args.config:
        raise UsageError("prepare needs --config FILE (the experiment's gin file, or a shipped config's name)")
    status = prepare.prepare_config(args.config, args.gin, args.data_dir)
    if status:
        print(status, file=sys.stderr, flush=True)
    return 0


def _configs_command(args) -> int:
    from revtrain import catalog
    for line in catalog.lines():
        print(line)
    return 0


def _export_command(args) -> int:
    from revtrain import export
    config = run_config(args.workdir)
    _parse_gin([config] + args.config, args.gin, workdir=args.workdir)
    _check_macros_used(args.gin)
    step = export.export_workdir(args.workdir, args.to, step=args.step, dtype=args.dtype)
    from revtrain import metrics as metrics_lib
    metrics_lib.log(f"exported step {step} of {os.path.abspath(args.workdir)} to {os.path.abspath(args.to)}")
    return 0


# Each command's runner (`_run`), in the order of the usage text.
_COMMANDS = {"train": _train_command, "eval": _eval_command, "sample": _sample_command, "check": _check_command,
             "plan": _plan_command, "export": _export_command, "prepare": _prepare_data_command,
             "configs": _configs_command}


# The commands that compile programs, with JAX's persistent compilation cache on (`revtrain.compile_cache`).
_COMPILING = ("train", "eval", "sample", "check", "plan", "export")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``revtrain`` console script. Returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    from revtrain.allocator import bound_retention
    bound_retention()  # before the first large buffer (revtrain.allocator)
    verbose = "--verbose" in argv
    try:
        args = parse_args(argv)
        _quiet_libraries(verbose)
        if args.command in _COMPILING:
            from revtrain.compile_cache import enable
            enable()  # (compiled programs kept on disk between commands, before the first compile)
        _init_distributed(args)
        return _run(args)
    except KeyboardInterrupt:  # Ctrl-C outside `train`'s own handling (see revtrain.lifecycle.interrupts)
        if verbose:
            raise
        print("revtrain: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # classify: usage/config errors -> 2, anything else -> 1
        if "revtrain.lifecycle.lost_peer" in sys.modules:
            sys.modules["revtrain.lifecycle.lost_peer"].exit_if_peer_lost(e)  # a lost process: one line, exit 1, now
        if verbose:
            raise
        code, line = _classify(e)
        print(f"revtrain: error: {line}", file=sys.stderr)
        return code
    finally:
        # A command's gin bindings end with it (main() may run several commands in one process).
        if "gin" in sys.modules:
            sys.modules["gin"].clear_config()


def _classify(e: Exception) -> tuple[int, str]:
    """The exit status and the one line the CLI prints for ``e`` (`revtrain.errors`: the base class decides)."""
    from revtrain.lifecycle.oom import describe, is_out_of_memory
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    status = exit_status(e)
    if status is not None:
        return status, first
    if isinstance(e, PermissionError):
        return EXIT_USAGE, f"cannot write: {first}"
    if is_out_of_memory(e):
        return EXIT_FAILURE, describe(e, "a computation", ["the batch size", "the sequence length"])
    return EXIT_FAILURE, f"{type(e).__name__}: {first} (run with --verbose for the traceback)"


if __name__ == "__main__":
    sys.exit(main())
