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
    """Largest expected gain first; findings without a bound after, by severity."""
    return sorted(findings, key=lambda f: (f.expected_speedup is None, -(f.expected_speedup or 0.0),
                                           _SEVERITY_ORDER[f.severity]))


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
