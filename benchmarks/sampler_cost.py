"""Sampler cost: CPU time per tick that sampling takes in the kernel process.

Every figure is thread CPU time (``time.thread_time()``) of synchronous calls on this
thread, so other processes' load affects it little (caches aside). Measured:

(a) ``NvmlSource.read()`` with the fake NVML of tests/fakenvml.py (8 Hopper-class GPUs with
    GPM, answering at once; its clock is frozen and stepped 0.1 s between ticks, i.e.
    10 Hz, with a GPM pair every tick), at 1 and 8 GPUs. The headline includes the fake's own time; the fake's share
    is estimated by replaying the exact NVML calls of the measured ticks (same functions,
    same arguments) straight into the fake, and "our cost" is the difference. A real
    driver's calls cost C time instead of the fake's Python, plus, for a few, real
    waiting (benchmarks/gpu_check.py measures that on a GPU).
(b) ``HostSource.read()`` (psutil): CPU, per core, the process tree, memory, disk, network,
    at 4 Hz and 10 Hz on a simulated clock (the source refreshes its child-process list
    and disk/network counters only every so often; see ``host_clock``), and at 10 Hz in
    real time (sleeping between reads, as the sampler thread does: caches go cold, and a
    read costs 2-3 times as much as back to back). Finding child
    processes costs in proportion to the processes on the host (psutil's ``children()``
    reads every /proc/<pid>/stat), so it is also measured with 500 extra idle processes
    that are not ours (what a shared server looks like).
(c) ``Trace.append`` of a full row: 8 GPUs x 17 metrics + 28 host columns (164).
(d) ``Sampler.tick()`` with the host source and 8 fake GPUs: the whole tick.

Target: <= 200 us of our own CPU time per GPU per tick.

    .venv/bin/python benchmarks/sampler_cost.py [--quick] [--json PATH]
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from _common import median, parse_args, print_header, setup_paths, strangers, table, verdict, write_json

setup_paths(fake_nvml=True)

TARGET_US_PER_GPU = 200.0
GPU_METRICS = ("util", "mem_util", "mem_used", "mem_total", "power", "power_limit", "temperature",
               "sm_clock", "sm_clock_max", "slowdown", "power_capped", "pcie_tx", "pcie_rx", "proc_mem",
               "sm_active", "tensor_active", "sm_occupancy", "dram_active")
HOST_COLUMNS = ("cpu.util", "cpu.iowait", *(f"cpu.core{i}.util" for i in range(16)), "proc.cpu",
                "proc.workers_cpu", "proc.workers", "proc.rss", "mem.used", "mem.total", "disk.read",
                "disk.write", "net.recv", "net.sent")


def full_row_columns(gpus: int = 8) -> list[str]:
    return [f"gpu{i}.{m}" for i in range(gpus) for m in GPU_METRICS] + list(HOST_COLUMNS)


def per_call_us(fn: Callable[[], Any], calls: int, between: Callable[[], Any] | None = None) -> list[float]:
    """Thread CPU time of each call of ``fn``, in microseconds (``between`` runs untimed)."""
    out = []
    clock = time.thread_time
    for _ in range(calls):
        if between is not None:
            between()
        t = clock()
        fn()
        out.append(1e6 * (clock() - t))
    return out


def summary(samples: list[float]) -> dict[str, float]:
    return {"mean_us": sum(samples) / len(samples), "median_us": median(samples), "calls": len(samples)}


# ------------------------------------------------------------------------------------- (a) NVML


def nvml_cost(gpus: int, ticks: int) -> dict[str, Any]:
    import pynvml

    from gpuwidget.sources.nvml import NvmlSource

    from fakenvml import FakeNvml

    fake = FakeNvml.gpus(gpus)
    # A hair over 0.1 s per tick: NvmlSource takes a GPM pair only >= 100 ms apart, and exact
    # 0.1 s steps of a float clock fall just short half the time; this way every tick does.
    fake.tick_s = 0.1001
    with fake.patched():
        source = NvmlSource()
        assert source.available, source.describe()
        for _ in range(5):  # first reads allocate GPM samples, read static facts
            fake.step()
            source.read()
        fake.reset_counts()
        times = per_call_us(source.read, ticks, between=fake.step)
        calls_per_tick = {name: count / ticks for name, count in sorted(fake.calls.items())}
        # Record the NVML calls of some ticks, then replay them into the fake alone.
        record_ticks = min(ticks, 500)
        recorded: list[list[tuple[Callable[..., Any], tuple[Any, ...]]]] = []
        saved = {}
        for name in dir(pynvml):
            if name.startswith("nvml") and callable(getattr(pynvml, name)) and hasattr(fake, name):
                saved[name] = getattr(pynvml, name)

                def recorder(*args: Any, _fn: Callable[..., Any] = saved[name]) -> Any:
                    recorded[-1].append((_fn, args))
                    return _fn(*args)

                setattr(pynvml, name, recorder)
        start_tick, start_time = fake._tick, fake.time
        try:
            for _ in range(record_ticks):
                fake.step()
                recorded.append([])
                source.read()
        finally:
            for name, fn in saved.items():
                setattr(pynvml, name, fn)
        # Back to the recorded ticks: the fake then answers as it did (same sample counts).
        fake._tick, fake.time = start_tick, start_time
        replay_us = []
        clock = time.thread_time
        for tick_calls in recorded:
            fake.step()
            t = clock()
            for fn, args in tick_calls:
                with contextlib.suppress(pynvml.NVMLError):
                    fn(*args)
            replay_us.append(1e6 * (clock() - t))
        source.close()
    total = summary(times)
    fake_share = sum(replay_us) / len(replay_us)
    return {
        "gpus": gpus,
        "ticks": ticks,
        "read_us": total["mean_us"],
        "read_median_us": total["median_us"],
        "fake_us": fake_share,
        "ours_us": total["mean_us"] - fake_share,
        "ours_per_gpu_us": (total["mean_us"] - fake_share) / gpus,
        "read_per_gpu_us": total["mean_us"] / gpus,
        "nvml_calls_per_tick": calls_per_tick,
    }


# ------------------------------------------------------------------------------------- (b) host


@contextlib.contextmanager
def host_clock() -> Iterator[Callable[[float], None]]:
    """Give the host source a simulated clock; yields ``advance(seconds)``.

    The host source refreshes some readings only every so often (its child-process scan,
    disk and network counters); reads in a tight loop would take nearly all of them from
    its cache. Stepping its clock by the sampling interval between reads makes each read
    cost what it costs at that rate, amortised refreshes included.
    """
    import gpuwidget.sources.host as host_module

    clock = [time.perf_counter()]
    saved = host_module.now

    def advance(seconds: float) -> None:
        clock[0] += seconds

    host_module.now = lambda: clock[0]  # type: ignore[assignment]
    try:
        yield advance
    finally:
        host_module.now = saved  # type: ignore[assignment]


def host_cost(reads: int, interval: float, extra_processes: int = 0, real_time: bool = False) -> dict[str, Any]:
    """Host reads at ``interval``: on the simulated clock back to back (warm caches), or in
    real time, sleeping between reads as the sampler thread does (cold caches, dearer)."""
    import psutil

    from gpuwidget.sources.host import HostSource

    with strangers(extra_processes), (contextlib.nullcontext(None) if real_time else host_clock()) as advance:
        def step() -> None:
            if advance is None:
                time.sleep(interval)
            else:
                advance(interval)

        source = HostSource()
        for _ in range(3):
            step()
            source.read()
        times = per_call_us(source.read, reads, between=step)
        processes = len(psutil.pids())
        source.close()
    return {"processes_on_host": processes, "extra_processes": extra_processes, "interval": interval,
            "real_time": real_time, "max_us": max(times), **summary(times)}


def host_profile(reads: int, interval: float) -> list[tuple[str, float]]:
    """Where a host read's time goes: the heaviest functions, cumulative us per read."""
    import cProfile
    import pstats

    from gpuwidget.sources.host import HostSource

    with host_clock() as advance:
        source = HostSource()
        source.read()
        profile = cProfile.Profile()
        for _ in range(reads):
            advance(interval)
            profile.enable()
            source.read()
            profile.disable()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    wanted = {"_read_cpu", "_read_process", "children", "_read_memory", "_read_io"}
    out = []
    for (filename, _, name), (_, _, _, cumulative, _) in stats.items():
        if name in wanted and ("gpuwidget" in filename or name == "children"):
            label = "psutil Process.children(recursive=True)" if name == "children" else f"HostSource.{name}"
            out.append((label, 1e6 * cumulative / reads))
    return sorted(out, key=lambda item: -item[1])


# ------------------------------------------------------------------------------------ (c) Trace


def append_cost(appends: int) -> dict[str, Any]:
    import random

    from gpuwidget.trace import Trace

    columns = full_row_columns(8)
    rng = random.Random(0)
    rows = [{name: rng.uniform(0, 100) for name in columns} for _ in range(64)]
    trace = Trace()
    t = time.thread_time()
    trace.append(0.0, rows[0])
    first_us = 1e6 * (time.thread_time() - t)
    counter = iter(range(1, 10**9))

    def one() -> None:
        k = next(counter)
        trace.append(0.1 * k, rows[k % 64])

    times = per_call_us(one, appends)
    return {"columns": len(columns), "first_append_us": first_us, **summary(times)}


# ------------------------------------------------------------------------------ (d) whole tick


def tick_cost(ticks: int) -> dict[str, Any]:
    from gpuwidget.sampler import Sampler
    from gpuwidget.sources.host import HostSource
    from gpuwidget.sources.nvml import NvmlSource
    from gpuwidget.trace import Trace

    from fakenvml import FakeNvml

    fake = FakeNvml.gpus(8)
    fake.tick_s = 0.1001
    with fake.patched(), host_clock() as advance:
        sources: list[Any] = [HostSource(), NvmlSource()]
        sampler = Sampler(sources, Trace(), interval=0.1)

        def step() -> None:
            fake.step()
            advance(fake.tick_s)

        for _ in range(3):
            step()
            sampler.tick()
        first = sampler.stats.cpu_time_s
        times = per_call_us(sampler.tick, ticks, between=step)
        stats_per_tick = (sampler.stats.cpu_time_s - first) / ticks
        for source in sources:
            source.close()
    return {"columns": len(sampler.trace.columns), "stats_cpu_per_tick_us": 1e6 * stats_per_tick,
            **summary(times)}


def main() -> None:
    args = parse_args("CPU time per sampler tick: NVML (fake), host, Trace.append, whole tick.")
    info = print_header("Sampler cost: thread CPU time per tick in the kernel process")
    from gpuwidget.options import DEFAULT_INTERVAL_S

    ticks = 200 if args.quick else 3000
    host_reads = 50 if args.quick else 1000
    crowd = 50 if args.quick else 500

    nvml = [nvml_cost(n, ticks) for n in (1, 8)]
    host = [host_cost(host_reads, interval) for interval in (DEFAULT_INTERVAL_S, 0.1)]
    host.append(host_cost(10 if args.quick else 50, 0.1, real_time=True))
    host_crowded = [host_cost(max(40, host_reads // 4), interval, crowd) for interval in (DEFAULT_INTERVAL_S, 0.1)]
    host_crowded.append(host_cost(10 if args.quick else 30, 0.1, crowd, real_time=True))
    profile = host_profile(max(40, host_reads // 5), 0.1)
    append = append_cost(2000 if args.quick else 20000)
    tick = tick_cost(max(100, ticks // 3))

    print()
    print("(a) NvmlSource.read(), fake NVML, 10 Hz clock; us of thread CPU per tick")
    table(["GPUs", "read (incl. fake)", "median", "fake's share", "ours", "ours per GPU"],
          [[r["gpus"], r["read_us"], r["read_median_us"], r["fake_us"], r["ours_us"], r["ours_per_gpu_us"]]
           for r in nvml])
    calls = nvml[1]["nvml_calls_per_tick"]
    listed = ", ".join(f"{name.removeprefix('nvml')} {count:g}" for name, count in calls.items())
    print(f"  NVML calls per tick at 8 GPUs: {sum(calls.values()):.1f} ({listed})")
    print()
    print("(b) HostSource.read(); us of thread CPU per read; simulated clock (back to back, warm caches)")
    print("    or real time (sleeping between reads like the sampler thread: cold caches, dearer)")
    table(["case", "processes on host", "rate", "clock", "reads", "mean", "median", "max (a refresh tick)"],
          [[("as found" if r["extra_processes"] == 0 else f"+{r['extra_processes']} idle processes (not ours)"),
            r["processes_on_host"], f"{1 / r['interval']:g} Hz", "real" if r["real_time"] else "simulated",
            r["calls"], r["mean_us"], r["median_us"], r["max_us"]]
           for r in host + host_crowded])
    print("  where a read's time goes at 10 Hz, as found (cProfile, cumulative us per read, profiler")
    print("  overhead included):")
    for label, us in profile:
        print(f"    {label:45s} {us:8.0f}")
    print()
    print("(c) Trace.append, full 8-GPU row; us of thread CPU per append")
    table(["columns", "first append (one-off)", "mean", "median"],
          [[append["columns"], append["first_append_us"], append["mean_us"], append["median_us"]]])
    print()
    print("(d) Sampler.tick() at 10 Hz: host + 8 fake GPUs + Trace.append; us of thread CPU per tick")
    table(["columns", "mean", "median", "% of a core"],
          [[tick["columns"], tick["mean_us"], tick["median_us"], f"{tick['mean_us'] * 10 / 1e4:.2f}"]])
    print()
    ours = nvml[1]["ours_per_gpu_us"]
    verdicts = [
        verdict("NVML source, our CPU time per GPU per tick (8 GPUs)", ours, TARGET_US_PER_GPU,
                higher_is_better=False, shown=f"{ours:.0f} us "
                f"({nvml[1]['read_per_gpu_us']:.0f} us with the fake's share)",
                target_shown=f"{TARGET_US_PER_GPU:.0f} us"),
        verdict("NVML source, our CPU time per GPU per tick (1 GPU)", nvml[0]["ours_per_gpu_us"],
                TARGET_US_PER_GPU, higher_is_better=False, shown=f"{nvml[0]['ours_per_gpu_us']:.0f} us",
                target_shown=f"{TARGET_US_PER_GPU:.0f} us"),
    ]
    write_json(args.json, {"benchmark": "sampler_cost", "machine": info, "quick": args.quick,
                           "nvml": nvml, "host": host, "host_crowded": host_crowded,
                           "host_profile_us": profile, "trace_append": append, "tick": tick,
                           "verdicts": verdicts})


if __name__ == "__main__":
    main()
