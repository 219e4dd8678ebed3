"""What planning costs a run (issue 59, "planning in seconds"): the budget planner's time objective, its
refusal, and the memory plan's share of a ``train`` start.

  python scripts/bench_planning.py budget  [--config configs/enwik_modern.gin] [--budget 1GiB] [--gin ...]
  python scripts/bench_planning.py refusal [--config ...] [--budget 64KiB]
  python scripts/bench_planning.py start   [--config ...] [--plan | --no-plan] [--repeat 3]
  (each: [--compile-cache DIR], the compiled programs kept in DIR as the CLI keeps them, `revtrain.compile_cache`)

``budget``: seconds of ``ReversibleTrainer.memory_budget = BUDGET`` planned with ``budget_objective = 'time'``
as ``train`` plans it before placing the state (the trainer's own planner on the run's batch shapes).
``refusal``: seconds until a budget below the least any plan needs is refused (the same planner). Both
give wall and CPU seconds (``cpu_s``: every thread's) and the compiles, traces and lowerings.
``start``: a ``train`` start's planning, first step and first evaluation in one process, warm (imports done,
the data read once): seconds of the memory plan (``--plan``), then of the state's init and the first step
(compiling the run's programs), then of one evaluation batch (compiling the evaluation programs), ``--repeat``
times over freshly built runs, each with the programs traced, lowered and compiled in it (count, seconds: JAX's
compile events; ``total_cpu_s``: the process's CPU seconds, every thread's); the plan's added time is
``--plan``'s ``total_s`` (or ``total_cpu_s``) less ``--no-plan``'s. Prints one JSON record (with the load average).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402


def _build(config: str, gin: list):
    from revtrain import registry
    from revtrain import run as run_lib
    registry.parse_gin([config], gin, None)
    return run_lib.build(say_data=False)


def _planning():
    try:
        from revtrain import planning
        return planning
    except ImportError:  # (before the planners moved into revtrain.planning)
        from revtrain import memory_plan
        return memory_plan


def _budget(args) -> dict:
    import gin as gin_lib
    gin = args.gin + [f"ReversibleTrainer.memory_budget = '{args.budget}'",
                      "ReversibleTrainer.budget_objective = 'time'"]
    run = _build(args.config, gin)
    planning = _planning()
    jax.monitoring.register_event_duration_secs_listener(_listen)
    _taken()
    start, cpu = time.perf_counter(), time.process_time()
    line, refused = "", None
    try:
        plan = planning.plan_budget(run)
        line = plan.line()
    except Exception as e:  # noqa: BLE001  (the refusal's line)
        refused = str(e).splitlines()[0]
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    gin_lib.clear_config()
    return {"seconds": round(seconds, 2), "cpu_s": round(cpu, 2), "line": line, "refused": refused,
            "events": _taken()}


_EVENTS = {"/jax/core/compile/backend_compile_duration": "compile",
           "/jax/core/compile/jaxpr_trace_duration": "trace",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower"}
_TALLY: dict = {}


def _listen(event, seconds, **_):
    name = _EVENTS.get(event)
    if name:
        n, t = _TALLY.get(name, (0, 0.0))
        _TALLY[name] = (n + 1, t + seconds)


def _taken() -> dict:
    """The compiles, traces and lowerings since the last call: ``{name: [count, seconds]}``."""
    out = {k: [n, round(t, 3)] for k, (n, t) in _TALLY.items()}
    _TALLY.clear()
    return out


def _start(args) -> dict:
    import gin as gin_lib
    jax.monitoring.register_event_duration_secs_listener(_listen)
    planning = _planning()
    out = []
    for _ in range(args.repeat):
        run = _build(args.config, args.gin)
        import numpy as np
        from revtrain.placement import global_batch
        spec = run.task.input_spec(run.cfg.batch_size)
        batch = global_batch({k: np.zeros(v.shape, v.dtype) for k, v in spec.items()}, run.mesh)
        espec = run.task.input_spec(run.ecfg.batch_size)  # (an evaluation batch: its weights too)
        eval_batch = {k: np.zeros(v.shape, v.dtype) for k, v in espec.items()}
        eval_batch["weights"] = np.ones(espec["targets"].shape, np.float32)
        eval_batch = global_batch(eval_batch, run.mesh)
        _taken()
        t0, c0 = time.perf_counter(), time.process_time()
        if args.plan:
            planning.check_everywhere(run)
        t1 = time.perf_counter()
        plan_events = _taken()
        ts = run.trainer.init()
        ts, metrics = run.trainer.train_step(ts, batch)
        jax.block_until_ready(metrics)
        t2 = time.perf_counter()
        step_events = _taken()
        jax.block_until_ready(run.trainer.eval_step(ts, eval_batch))
        t3, c3 = time.perf_counter(), time.process_time()
        out.append({"plan_s": round(t1 - t0, 3), "init_and_first_step_s": round(t2 - t1, 3),
                    "first_eval_s": round(t3 - t2, 3), "total_s": round(t3 - t0, 3), "total_cpu_s": round(c3 - c0, 3),
                    "plan_events": plan_events, "step_events": step_events, "eval_events": _taken()})
        gin_lib.clear_config()
    return {"runs": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["budget", "refusal", "start"])
    p.add_argument("--config", default="configs/enwik_modern.gin")
    p.add_argument("--gin", action="append", default=[])
    p.add_argument("--budget", default=None)
    p.add_argument("--plan", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--compile-cache", default=None,
                   help="keep compiled programs in this directory as the CLI does (revtrain.compile_cache); "
                        "default: none (every program compiled)")
    args = p.parse_args()
    if args.compile_cache:
        from revtrain import compile_cache
        compile_cache.enable({"REVTRAIN_COMPILE_CACHE": args.compile_cache})
    if args.what == "start":
        record = _start(args)
    else:
        args.budget = args.budget or ("1GiB" if args.what == "budget" else "64KiB")
        record = _budget(args)
    record.update(what=args.what, config=args.config, gin=args.gin, plan=args.plan, compile_cache=args.compile_cache,
                  load_average=[round(v, 2) for v in os.getloadavg()], jax=jax.__version__)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
