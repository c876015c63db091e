"""How late a tick's stack read comes while the loop runs Python, with and without the prompt GIL.

A sampler tick with a ``first`` listener (the stack sample) is woken a switch interval early and lowers
the interval until its read (``gpuwidget.sampler.PromptGil``); without it, the tick waits for the GIL
for a switch interval (5 ms) before the loop is asked to let go. In one process, in rotating order, a
``Sampler`` whose first listener reads the main thread's stack (``probes.stack.thread_stack``) runs
beside a loop of pure Python on the main thread (a tokenizer's kind of work, which never lets go of
the GIL itself), each way: ``prompt`` (as shipped) and ``plain`` (``Sampler._wait_until`` as a single
wait). Reported: the median and 90th percentile of how late each read came after its tick was due,
the loop's iterations per second (the cost of the extra wake to a GIL-bound loop, as a ratio of the
two, side by side), and the sampler thread's CPU per tick.

    .venv/bin/python benchmarks/prompt_gil.py [--quick] [--json PATH] [--rounds N]
"""

from __future__ import annotations

import threading
import time
from typing import Any

from _common import median, parse_args, print_header, setup_paths, table, write_json

setup_paths()

from gpuwidget.clock import now  # noqa: E402
from gpuwidget.probes.stack import thread_stack  # noqa: E402
from gpuwidget.sampler import Sampler, tick_due  # noqa: E402
from gpuwidget.trace import Trace  # noqa: E402

INTERVALS = (0.25, 0.05)  # the default, and the tests' 20 Hz


def plain_wait(self: Sampler, due: float) -> bool:
    return self._stop.wait(max(0.0, due - now()))


PROMPT_WAIT = Sampler._wait_until


def one_round(prompt: bool, interval: float, seconds: float) -> dict[str, float]:
    Sampler._wait_until = PROMPT_WAIT if prompt else plain_wait  # type: ignore[method-assign]
    main = threading.get_ident()
    late: list[float] = []
    cpu: list[float] = []

    def first(_trace: Trace) -> None:
        due = tick_due()
        thread_stack(main)
        if due is not None:
            late.append(now() - due)
        cpu.append(time.thread_time())

    sampler = Sampler([], Trace(), interval=interval, first=[first]).start()
    count = 0
    end = time.perf_counter() + seconds
    started = time.perf_counter()
    while time.perf_counter() < end:  # pure Python: lets go of the GIL only when asked
        count += 1
    elapsed = time.perf_counter() - started
    sampler.stop()
    Sampler._wait_until = PROMPT_WAIT  # type: ignore[method-assign]
    reads = sorted(late[1:])
    per_tick = (cpu[-1] - cpu[1]) / (len(cpu) - 2) if len(cpu) > 2 else float("nan")
    return {"late_ms": 1e3 * median(reads), "late_p90_ms": 1e3 * reads[int(0.9 * (len(reads) - 1))],
            "rate": count / elapsed, "tick_cpu_us": 1e6 * per_tick, "reads": len(reads)}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], [("--rounds", {"type": int, "default": 6})])
    header = print_header("Prompt GIL: stack reads beside a loop of pure Python")
    rounds = 2 if args.quick else args.rounds
    seconds = 1.0 if args.quick else 2.0
    results: dict[str, Any] = {"header": header, "rounds": rounds, "seconds": seconds, "intervals": {}}
    rows = []
    for interval in INTERVALS:
        got: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        for index in range(rounds):
            for prompt in ((True, False) if index % 2 == 0 else (False, True)):
                got[prompt].append(one_round(prompt, interval, seconds))
        ratios = [a["rate"] / b["rate"] for a, b in zip(got[True], got[False])]
        results["intervals"][str(interval)] = {"prompt": got[True], "plain": got[False], "rate_ratios": ratios}
        for prompt in (True, False):
            runs = got[prompt]
            rows.append([f"{interval} s", "prompt" if prompt else "plain",
                         f"{median([r['late_ms'] for r in runs]):.2f}",
                         f"{median([r['late_p90_ms'] for r in runs]):.2f}",
                         f"{median([r['tick_cpu_us'] for r in runs]):.0f}",
                         f"{median(ratios):.4f}" if prompt else "1"])
    table(["interval", "tick", "read late, median ms", "p90 ms", "sampler CPU a tick us",
           "loop rate, prompt / plain (median of rounds)"], rows)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
