"""The scale benchmark (make bench-scale; docs/memory.md): a ladder of Llama-style byte models, each trainer in
its own process under the memory plan, host memory by phase.

For each model size, optimizer (AdamW float32, Adafactor) and trainer (StandardTrainer, ReversibleTrainer,
ReversibleTrainer + offload) it runs, each in a fresh child process:

1. ``revtrain train`` of ``configs/llama_small.gin`` with the size's ``LlamaModel`` settings (``form
   'standard'``), batch 2 x 128 bytes, 3 steps, a checkpoint every 2 steps, one evaluation batch;
2. the same command with 5 steps: it restores the newest checkpoint and trains 2 more;
3. ``revtrain eval`` of the workdir.

The tracer resets the child's peak resident memory (``VmHWM``, by writing 5 to ``/proc/PID/clear_refs``)
at every line the run prints and whenever a checkpoint directory appears, and reads the peak just before
each reset: the peak of each phase (init, steps, save, restore, eval) is the largest over its windows. It
also records seconds per step (steps after the first of each run, which compiles; a step never includes a
save), seconds per checkpoint (from the step's line to its checkpoint directory: a state of at most
``limits.ASYNC_MAX_BYTES`` is written in the background, overlapping the next step), and the plan's
host estimate (``plan_host_bytes`` of the first ``train.jsonl`` record). A configuration the plan refuses
(exit 2, one line) is recorded as refused; larger sizes of the same trainer and optimizer are then skipped.

A disk-tier point (``offload = 'disk'``) also records its step's reads and writes, the disk's sequential
bandwidth measured once more right after it (`disk_probes.bandwidth`, uncached, 512 MiB) and the ratio of its
step time to the larger of the same size's in-memory step (the ``offload`` trainer) and that I/O bound.

Outputs: ``--out`` (JSON), the same name with ``.png`` (bytes per parameter by phase and trainer) and a
markdown table on stdout.

  python scripts/bench_scale.py --sizes 25M,57M --trainers standard,reversible --optimizers adamw
  python scripts/bench_scale.py --point 'd_model=1024 num_layers=12 num_heads=16 num_kv_heads=16 d_ff=2816'
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import bench_common as common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "llama_small.gin")

# name: LlamaModel sizes, and the optimizers the point is run with (None: every one asked for).
LADDER = {
    "tiny": (dict(d_model=64, num_layers=2, num_heads=2, num_kv_heads=2, d_ff=128), None),  # checks the script
    "25M": (dict(d_model=512, num_layers=8, num_heads=8, num_kv_heads=8, d_ff=1408), None),
    "57M": (dict(d_model=768, num_layers=8, num_heads=12, num_kv_heads=12, d_ff=2048), None),
    "136M": (dict(d_model=1024, num_layers=12, num_heads=16, num_kv_heads=16, d_ff=2816), None),
    "309M": (dict(d_model=1024, num_layers=24, num_heads=16, num_kv_heads=16, d_ff=2816), None),
    "1.44B": (dict(d_model=2048, num_layers=32, num_heads=16, num_kv_heads=4, d_ff=5632), None),
    "3B": (dict(d_model=2560, num_layers=44, num_heads=20, num_kv_heads=4, d_ff=6912), ("adafactor",)),
}
DEFAULT_SIZES = "25M,57M,136M,309M,1.44B,3B"
TRAINERS = {
    "standard": ("StandardTrainer", ["train.trainer = @StandardTrainer"]),
    "reversible": ("ReversibleTrainer", ["train.trainer = @ReversibleTrainer"]),
    "offload": ("ReversibleTrainer + offload", ["train.trainer = @ReversibleTrainer", "ReversibleTrainer.offload = True"]),
    "disk": ("ReversibleTrainer + offload='disk'", ["train.trainer = @ReversibleTrainer", "ReversibleTrainer.offload = 'disk'"]),
}
OPTIMIZERS = {
    "adamw": ("AdamW", []),  # the config's own: optax.adamw, float32 moments
    "adafactor": ("Adafactor", ["train.optimizer = @optax.adafactor"]),
}
PHASES = ("init", "steps", "save", "restore", "eval")
COMMON = ["WARMUP = 1", "train.batch_size = 2", "train.log_every = 1", "train.checkpoint_every = 2",
          "ByteLMTask.sequence_length = 128", "evaluate.max_batches = 1", "train.sample_every = 0",
          "LlamaModel.form = 'standard'",
          # one checkpoint kept (as configs/llama_1b.gin): at the default 3, a 1.44 B run's 16 GiB checkpoints (steps
          # 2, 3, 4 and the final save at 5) filled this machine's disk in the resumed run's last save
          "train.keep_checkpoints = 1"]
POLL_S = 0.05
DISK_PROBE_BYTES = 512 * 2**20  # the disk tier's points: the sequential bandwidth probe, written and read back


def _hwm(pid: int) -> int | None:
    """The child's ``VmHWM`` in bytes (None once it has exited)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_hwm(pid: int) -> None:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _kind(line: str) -> str | None:
    """What a line of the run marks the end of (None: not a phase boundary)."""
    if line.startswith("memory plan ("):
        return "planned"
    if line.startswith("resumed from checkpoint"):
        return "restored"
    if re.search(r" trainer, [\d,]+ params", line):
        return "initialized"
    m = re.match(r"step (\d+)/\d+ \|", line)
    if m:
        return f"step {m.group(1)}"
    if line.startswith("eval at step"):
        return "evaluated"
    if line.startswith("done:"):
        return "done"
    return None


def trace(cmd: list, workdir: str, timeout_s: float) -> dict:
    """Runs ``cmd`` (a revtrain command on ``workdir``) and cuts its life into windows at each line it prints
    (`_kind`) and at each new checkpoint directory, with the child's peak resident bytes and the time of
    each window's end.

    Returns ``{"rc", "seconds", "events": [{"event", "t", "peak_bytes"}], "stderr_tail", "lines"}``: ``t`` in
    seconds since the start, ``peak_bytes`` the window's VmHWM; the last event is ``"exit"``.
    """
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put((time.monotonic(), s.rstrip("\n"))) for s in proc.stderr],
                     daemon=True).start()
    ckpts = os.path.join(workdir, "checkpoints")
    seen = set(os.listdir(ckpts)) if os.path.isdir(ckpts) else set()
    events, text, last = [], [], 0

    def cut(name: str, t: float) -> None:
        peak = _hwm(proc.pid)
        _reset_hwm(proc.pid)
        events.append({"event": name, "t": round(t - t0, 3), "peak_bytes": peak if peak is not None else last})

    while True:
        done = proc.poll() is not None
        while True:
            try:
                t, line = lines.get_nowait()
            except queue.Empty:
                break
            text.append(line)
            kind = _kind(line)
            if kind is not None and not done:
                cut(kind, t)
        if os.path.isdir(ckpts):
            for name in sorted(set(os.listdir(ckpts)) - seen):
                seen.add(name)
                if name.isdigit() and not done:
                    cut(f"saved {name}", time.monotonic())
        if done:
            break
        now = _hwm(proc.pid)
        last = now if now is not None else last
        if time.monotonic() - t0 > timeout_s:
            proc.kill()
        time.sleep(POLL_S)
    time.sleep(0.2)  # the reader's last lines
    while not lines.empty():
        text.append(lines.get()[1])
    events.append({"event": "exit", "t": round(time.monotonic() - t0, 3), "peak_bytes": last})
    return {"rc": proc.returncode, "seconds": round(time.monotonic() - t0, 1), "events": events, "lines": text,
            "stderr_tail": text[-3:]}


def phases(first: dict, second: dict, evaluation: dict) -> dict:
    """Each phase's peak resident bytes and the step and checkpoint times, from the three traces.

    A window belongs to the phase of the event that ends it: the start up to the trainer's line is init
    (build, plan, init) or restore (build, plan, restore); a step line ends a step; a checkpoint directory a
    save; the final evaluation, the end of the run and the ``revtrain eval`` process are eval. The first step
    of each run (it compiles) is left out of the step time and counted in the steps phase.
    """
    peaks = dict.fromkeys(PHASES, 0)
    step_s, save_s = [], []
    for run in (first, second):
        prev = None
        for e in run["events"]:
            name = e["event"]
            if name in ("planned", "initialized"):
                phase = "init"
            elif name == "restored" or (name == "planned" and run is second):
                phase = "restore"
            elif name.startswith("step"):
                phase = "steps"
                if prev is not None and (prev["event"].startswith(("step", "saved"))):
                    step_s.append(e["t"] - prev["t"])
            elif name.startswith("saved"):
                phase = "save"
                if prev is not None and prev["event"].startswith("step"):
                    save_s.append(e["t"] - prev["t"])
            else:
                phase = "eval"
            if run is second and phase == "init":
                phase = "restore"
            peaks[phase] = max(peaks[phase], e["peak_bytes"] or 0)
            prev = e
    peaks["eval"] = max([peaks["eval"]] + [e["peak_bytes"] or 0 for e in evaluation["events"]])
    return {"peak_bytes": peaks, "step_s": round(statistics.median(step_s), 2) if step_s else None,
            "step_s_all": [round(s, 2) for s in step_s],
            "checkpoint_s": round(statistics.median(save_s), 2) if save_s else None,
            "checkpoint_s_all": [round(s, 2) for s in save_s]}


def _records(workdir: str) -> list:
    with open(os.path.join(workdir, "metrics", "train.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _device_peak(records: list) -> dict:
    """The largest ``peak_device_bytes`` of the run's records and how it was found (``memory_stats``:
    the device's ``peak_bytes_in_use``; ``estimate`` on the CPU)."""
    metered = [r for r in records if r.get("peak_device_bytes")]
    if not metered:
        return {}
    top = max(metered, key=lambda r: r["peak_device_bytes"])
    return {"peak_device_bytes": top["peak_device_bytes"], "peak_device_bytes_method": top.get("peak_device_bytes_method")}


def run_config(size: str, sizes: dict, trainer: str, optimizer: str, timeout_s: float, quick: bool = False) -> dict:
    """One configuration: train 3 steps, resume to 5, eval (each a child process); ``quick``: only the
    first run, with no periodic checkpoint (init, steps, the final save, the final evaluation).

    Returns its record: ``status`` (``"ok"``, ``"refused"`` with the plan's line, or ``"error"``), the
    plan's host estimate (bytes), the peak resident bytes by phase and bytes per parameter, the device's
    peak bytes (``memory_stats`` on an accelerator), seconds per step and per checkpoint."""
    workdir = tempfile.mkdtemp(prefix="bench_scale_")
    shutil.rmtree(workdir)  # the run creates it
    gin = COMMON + [f"LlamaModel.{k} = {v}" for k, v in sizes.items()] + TRAINERS[trainer][1] + OPTIMIZERS[optimizer][1]
    args = ["--config", CONFIG, "--workdir", workdir] + [a for g in gin for a in ("--gin", g)]
    train = [sys.executable, "-m", "revtrain", "train"] + args
    out = {"size": size, **sizes, "trainer": TRAINERS[trainer][0], "optimizer": OPTIMIZERS[optimizer][0]}
    try:
        first = trace(train + ["--gin", "STEPS = 3"] + (["--gin", "train.checkpoint_every = 0"] if quick else []),
                      workdir, timeout_s)
        if first["rc"] == 2 and any("memory plan does not fit" in s for s in first["lines"]):
            return {**out, "status": "refused", "refusal": next(s for s in first["lines"] if "memory plan" in s),
                    "seconds": first["seconds"]}
        if first["rc"] != 0:
            return {**out, "status": "error", "phase": "train", "rc": first["rc"], "stderr_tail": first["stderr_tail"]}
        record = _records(workdir)[0]
        empty = {"events": [], "seconds": 0.0, "rc": 0}
        second = trace(train + ["--gin", "STEPS = 5"], workdir, timeout_s) if not quick else empty
        if second["rc"] != 0:  # (the phases measured up to the failure kept: a disk filled by the last save, say)
            return {**out, "status": "error", "phase": "resume", "rc": second["rc"], "stderr_tail": second["stderr_tail"],
                    "peak_bytes_before_the_error": phases(first, second, empty)["peak_bytes"]}
        evaluation = empty if quick else trace([sys.executable, "-m", "revtrain", "eval", "--workdir", workdir],
                                               workdir, timeout_s)
        if evaluation["rc"] != 0:
            return {**out, "status": "error", "phase": "eval", "rc": evaluation["rc"],
                    "peak_bytes_before_the_error": phases(first, second, empty)["peak_bytes"],
                    "stderr_tail": evaluation["stderr_tail"]}
        params = int(re.search(r"([\d,]+) params", next(s for s in first["lines"] if _kind(s) == "initialized"))
                     .group(1).replace(",", ""))
        measured = phases(first, second, evaluation)
        peak = max(measured["peak_bytes"].values())
        out.update(status="ok", num_params=params, plan_host_bytes=record.get("plan_host_bytes"),
                   plan_device_bytes=record.get("plan_device_bytes"), **_device_peak(_records(workdir)),
                   plan_parts={k[len("plan_host_"):-len("_bytes")]: v for k, v in record.items()
                               if k.startswith("plan_host_") and k != "plan_host_bytes"},
                   host_limit_bytes=record.get("host_limit_bytes"), **measured, run_peak_bytes=peak,
                   bytes_per_param={k: round(v / params, 2) for k, v in measured["peak_bytes"].items()},
                   peak_phase=max(measured["peak_bytes"], key=measured["peak_bytes"].get),
                   seconds=round(first["seconds"] + second["seconds"] + evaluation["seconds"], 1),
                   events={"train": first["events"], "resume": second["events"], "eval": evaluation["events"]})
        if out["plan_host_bytes"]:
            out["plan_over_peak"] = round(out["plan_host_bytes"] / peak, 3)
        last = _records(workdir)[-1]
        if "disk_write_bytes" in last:  # the disk tier: a step's I/O against the disk's bandwidth (the plan's)
            io = {k: last[k] for k in last if k.startswith("disk_")}
            io.update({k: record[k] for k in record if k.startswith("plan_io_")})
            io["step_seconds"] = 1 / last["steps_per_sec"] if last.get("steps_per_sec") else None
            if io["step_seconds"]:
                io["achieved_bytes_per_sec"] = (io["disk_read_bytes"] + io["disk_write_bytes"]) / io["step_seconds"]
            # The disk's sequential bandwidth measured now, in this run, on the workdir's file system (not cached).
            from revtrain.tiers import disk_probes
            bw = disk_probes.bandwidth(workdir, cache=None, nbytes=DISK_PROBE_BYTES)
            io.update(measured_read_bytes_per_sec=bw["read"], measured_write_bytes_per_sec=bw["write"])
            io["io_bound_seconds"] = io["disk_read_bytes"] / bw["read"] + io["disk_write_bytes"] / bw["write"]
            out["disk"] = io
        return out
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def table(result: dict) -> str:
    """The markdown table: one row per configuration (GiB by phase, bytes per parameter at the peak)."""
    rows = ["| model | params | optimizer | trainer | plan | " + " | ".join(PHASES)
            + " | peak (B/p) | plan / peak | s/step | s/checkpoint |",
            "|---" * (9 + len(PHASES)) + "|"]
    for r in result["runs"]:
        name = f"{r['size']} (d {r['d_model']}, {r['num_layers']} blocks)"
        if r["status"] != "ok":
            why = r.get("refusal") or r.get("note") or "; ".join(r.get("stderr_tail", []))[:160] or f"exit {r.get('rc')}"
            rows.append(f"| {name} | | {r['optimizer']} | {r['trainer']} | **{r['status']}**: {why} |"
                        + " |" * (len(PHASES) + 4))
            continue
        g = lambda b: f"{b / 2**30:.2f}"  # noqa: E731
        rows.append(f"| {name} | {r['num_params'] / 1e6:,.1f} M | {r['optimizer']} | {r['trainer']} | "
                    f"{g(r['plan_host_bytes']) if r.get('plan_host_bytes') else '-'} | "
                    + " | ".join(g(r["peak_bytes"][p]) for p in PHASES)
                    + f" | {g(r['run_peak_bytes'])} ({r['run_peak_bytes'] / r['num_params']:.1f}) | {r.get('plan_over_peak', '-')} | "
                    f"{r['step_s']} | {r['checkpoint_s']} |")
    text = "\n".join(rows) + "\n(GiB of peak resident memory, VmHWM, by phase; plan: the memory plan's host estimate)"
    disk = [r for r in result["runs"] if r.get("status") == "ok" and r.get("disk")]
    if disk:
        rows = ["", "| model | optimizer | s/step disk | s/step in memory | I/O a step (GiB read / written) | "
                "disk read / write GB/s (measured) | achieved GB/s | I/O bound s | disk / max(memory, I/O) |",
                "|---|---|---:|---:|---|---|---:|---:|---:|"]
        for r in disk:
            io, o = r["disk"], r.get("overlap") or {}
            rows.append(f"| {r['size']} | {r['optimizer']} | {r['step_s']} | {o.get('memory_step_s', '-')} | "
                        f"{io['disk_read_bytes'] / 2**30:.2f} / {io['disk_write_bytes'] / 2**30:.2f} | "
                        f"{io['measured_read_bytes_per_sec'] / 1e9:.2f} / {io['measured_write_bytes_per_sec'] / 1e9:.2f} | "
                        f"{io.get('achieved_bytes_per_sec', 0) / 1e9:.2f} | {io['io_bound_seconds']:.1f} | "
                        f"{o.get('ratio', '-')} |")
        text += "\n".join(rows) + ("\n(the disk tier's step against the larger of the same model's step with its "
                                   "state in memory, ReversibleTrainer + offload, and its bytes over the disk's "
                                   "sequential bandwidth measured in this run)")
    return text


def overlap(result: dict) -> None:
    """For each disk-tier point: its step time against the larger of the in-memory step (the same size and
    optimizer with ``offload = True``) and its I/O bound (``r["overlap"]``; issue 37's target: at most 1.3)."""
    runs = [r for r in result["runs"] if r.get("status") == "ok"]
    for r in runs:
        if not r.get("disk") or not r.get("step_s"):
            continue
        mem = next((m for m in runs if m["size"] == r["size"] and m["optimizer"] == r["optimizer"]
                    and m["trainer"] == TRAINERS["offload"][0] and m.get("step_s")), None)
        bound = max(mem["step_s"] if mem else 0.0, r["disk"]["io_bound_seconds"])
        r["overlap"] = {"memory_step_s": mem["step_s"] if mem else None,
                        "ratio": round(r["step_s"] / bound, 3) if bound else None}


def plot(result: dict, png: str) -> None:
    """Bytes per parameter by phase (bars), one panel per optimizer, one group per size and trainer."""
    plt = common.pyplot()
    runs = [r for r in result["runs"] if r["status"] == "ok"]
    optimizers = sorted({r["optimizer"] for r in runs}) or ["-"]
    fig, axes = plt.subplots(len(optimizers), 1, figsize=(11, 3.6 * len(optimizers)), squeeze=False)
    for ax, opt in zip(axes[:, 0], optimizers):
        mine = [r for r in runs if r["optimizer"] == opt]
        width = 0.8 / len(PHASES)
        for j, phase in enumerate(PHASES):
            ax.bar([i + j * width for i in range(len(mine))], [r["bytes_per_param"][phase] for r in mine], width,
                   label=phase)
        ax.scatter([i + 0.4 - width / 2 for i in range(len(mine))],
                   [r["plan_host_bytes"] / r["num_params"] for r in mine], marker="_", s=400, color="k", zorder=3,
                   label="plan")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(mine))])
        ax.set_xticklabels([f"{r['size']}\n{r['trainer'].replace('ReversibleTrainer', 'Reversible')}" for r in mine],
                           fontsize=7)
        ax.set_ylabel("peak RSS / parameter (bytes)")
        ax.set_title(f"{opt}, batch 2 x 128 (this machine's CPU)")
        ax.legend(fontsize=7, ncol=6)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def _wait_while(path: str | None) -> None:
    while path and os.path.exists(path):
        time.sleep(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"ladder points, ascending ({', '.join(LADDER)})")
    p.add_argument("--point", action="append", default=[],
                   help="an extra model 'd_model=.. num_layers=.. num_heads=.. num_kv_heads=.. d_ff=..' (repeatable)")
    p.add_argument("--trainers", default=",".join(TRAINERS), help=f"of {', '.join(TRAINERS)}")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help=f"of {', '.join(OPTIMIZERS)}")
    p.add_argument("--out", default="bench_scale.json", help="JSON out (the plot beside it, .png)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds each child process may run")
    p.add_argument("--quick", action="store_true", help="only the first run, with its final save and evaluation "
                                                         "(no periodic checkpoint, no resume, no revtrain eval)")
    p.add_argument("--wait_while", help="before each configuration, wait while this file exists (a shared "
                                        "machine's marker of a large run)")
    a = p.parse_args()
    ladder = []
    for name in [s for s in a.sizes.split(",") if s]:
        if name not in LADDER:
            p.error(f"unknown size {name!r} (known: {', '.join(LADDER)})")
        ladder.append((name, *LADDER[name]))
    for spec in a.point:
        sizes = {k: int(v) for k, v in (kv.split("=") for kv in spec.split())}
        ladder.append((f"d{sizes['d_model']}x{sizes['num_layers']}", sizes, None))
    trainers = [t for t in a.trainers.split(",") if t]
    optimizers = [o for o in a.optimizers.split(",") if o]
    for t in trainers:
        if t not in TRAINERS:
            p.error(f"unknown trainer {t!r} (known: {', '.join(TRAINERS)})")
    for o in optimizers:
        if o not in OPTIMIZERS:
            p.error(f"unknown optimizer {o!r} (known: {', '.join(OPTIMIZERS)})")
    result = {"batch": "2 x 128 bytes", "config": "configs/llama_small.gin", "machine": f"{os.cpu_count()} CPUs",
              "runs": []}
    refused = set()
    for name, sizes, only in ladder:
        for opt in optimizers:
            if only is not None and opt not in only:
                continue
            for t in trainers:
                if (t, opt) in refused:
                    result["runs"].append({"size": name, **sizes, "trainer": TRAINERS[t][0],
                                           "optimizer": OPTIMIZERS[opt][0], "status": "skipped",
                                           "refusal": "a smaller size was refused"})
                    continue
                _wait_while(a.wait_while)
                print(f"bench_scale: {name} {OPTIMIZERS[opt][0]} {TRAINERS[t][0]}", file=sys.stderr, flush=True)
                r = run_config(name, sizes, t, opt, a.timeout, a.quick)
                if r["status"] == "refused":
                    refused.add((t, opt))
                print(json.dumps({k: v for k, v in r.items() if k != "events"}), flush=True)  # (gpu_report.sh)
                result["runs"].append(r)
                common.write_outputs(result, a.out, lambda _: "", plot, os.path.splitext(a.out)[0] + ".png")
    overlap(result)
    common.write_outputs(result, a.out, table, plot, os.path.splitext(a.out)[0] + ".png")


if __name__ == "__main__":
    main()
