"""The advisor: run every rule over a run's figures and rank what they found.

Pure: ``(summary, workload, machine) -> list[Finding]``. A rule that fails is logged and
skipped; it never takes the report down with it.
"""

from __future__ import annotations

import logging

from gpuwidget.advice.finding import Finding
from gpuwidget.advice.rules import RULES
from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts

log = logging.getLogger("gpuwidget")

_SEVERITY_ORDER = {"critical": 0, "warn": 1, "info": 2}


def rank(findings: list[Finding]) -> list[Finding]:
    """The findings in the order the panel shows them, the first being its headline.

    One gain orders them: ``Finding.expected_speedup``, what the finding's own change can gain by
    the measurement (each rule takes it from its evidence: a loader's from the times to build and
    to use a batch, contention's from the run delay, a stall's from its share of the loop). The
    largest comes first, a machine's cause (``Finding.machine_level``) wherever its gain puts it;
    then the findings whose measurement gives no figure, by severity; last, those with nothing
    to gain (``Finding.nothing_to_gain``: it would show as 1.00x), by severity.
    """
    def key(finding: Finding) -> tuple[int, float, int]:
        tier = 2 if finding.nothing_to_gain else 1 if finding.expected_speedup is None else 0
        return tier, -(finding.expected_speedup or 0.0), _SEVERITY_ORDER[finding.severity]

    return sorted(findings, key=key)


def advise(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> list[Finding]:
    findings: list[Finding] = []
    for rule, check in RULES.items():
        try:
            finding = check(summary, workload, machine)
        except Exception as exc:  # noqa: BLE001 - one broken rule must not hide the others
            log.warning("gpuwidget: rule %s failed: %r", rule, exc)
            continue
        if finding is not None:
            findings.append(finding)
    return rank(findings)
