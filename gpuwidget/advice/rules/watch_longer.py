"""watch-longer: the loop ran too briefly at its steady state for a cause to be named; how long to watch.

The loop's causes are named only from enough steady steps and seconds (gpuwidget.advice.evidence:
MIN_CAUSE_STEPS, MIN_CAUSE_LOOP_S). Below them this information says what was seen and how
many steps, and seconds, a watch needs, so a short cell is not answered with a guess (a 0.23 s
cell of 32 in-memory batches was once called io-bound) nor with "no cause found".
"""

from __future__ import annotations

from gpuwidget.advice.evidence import MIN_CAUSE_LOOP_S, MIN_CAUSE_STEPS, loop_evidence
from gpuwidget.advice.finding import Finding
from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts
from gpuwidget.report import fmt_seconds, warmup_sentence

RULE = "watch-longer"


def check(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> Finding | None:
    seen = loop_evidence(workload)
    if seen is None or seen.enough:
        return None
    split = seen.warmup
    watch_steps, watch_s = seen.steps_to_watch(), seen.seconds_to_watch()
    cause = summary.get("warmup_cause")
    if split.all_warmup:
        what = warmup_sentence(split.steps, split.seconds, cause, all_warmup=True)
        title = f"No steady state yet: watch {watch_steps} steps beyond the warm-up"
        more = f"{watch_steps} steps after the warm-up"
    else:
        what = f"the loop ran {seen.steady_steps} steady step{'s' if seen.steady_steps != 1 else ''} in " \
               f"{fmt_seconds(seen.steady_s)}"
        if split.steps:
            what += f" ({warmup_sentence(split.steps, split.seconds, cause)})"
        title = f"Too short to name a cause: watch at least {fmt_seconds(watch_s)} ({watch_steps} steps)"
        more = f"{watch_steps} steps, about {fmt_seconds(watch_s)} with the warm-up"
    return Finding(
        rule=RULE,
        severity="info",
        title=title,
        evidence={"steps": seen.steps, "steady_steps": seen.steady_steps, "steady_s": round(seen.steady_s, 3),
                  "warmup_steps": split.steps, "warmup_s": round(split.seconds, 3),
                  "min_steady_steps": MIN_CAUSE_STEPS, "min_steady_s": MIN_CAUSE_LOOP_S,
                  "watch_steps": watch_steps, "watch_s": round(watch_s, 2)},
        suggestion=(f"{what[:1].upper() + what[1:]}. A cause of idle time is named from at least {MIN_CAUSE_STEPS} "
                    f"steady steps lasting {fmt_seconds(MIN_CAUSE_LOOP_S)} or more: fewer hold too few readings of "
                    "the host's counters to tell waiting on storage from CPU work or contention, and too short "
                    f"a loop for a change such as more workers to pay back its start-up. Watch {more}."),
    )
