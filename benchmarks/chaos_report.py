"""The chaos soak's report (benchmarks/chaos_soak.py): what --out holds, the head's fault
events counted, and the table printed at the end."""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos_checks import Figures
from chaos_faults import Fault
from chaos_traffic import Outcome

MUST_BE_ZERO = ("lost", "wrong", "hang", "bad_status")
VERDICTS = ("completed", "failed_cleanly", "cancelled", *MUST_BE_ZERO)


@dataclass
class Report:
    """What --out holds."""

    options: dict[str, Any]
    seconds: float
    requests: dict[str, int] = field(default_factory=dict)  # by verdict, and "sent"
    faults: dict[str, int] = field(default_factory=dict)  # applied, by kind
    faults_not_applied: dict[str, int] = field(default_factory=dict)
    events: dict[str, int] | None = None  # the head's appliance.events lines by fault kind
    start: Figures | None = None
    end: Figures | None = None
    violations: list[str] = field(default_factory=list)
    agent_exits: list[int] = field(default_factory=list)
    fault_log: list[Fault] = field(default_factory=list)
    bad_requests: list[Outcome] = field(default_factory=list)
    interrupted: bool = False  # stopped by SIGINT before its bars were passed

    @property
    def failed(self) -> bool:
        bad = any(self.requests.get(k) for k in MUST_BE_ZERO) or bool(self.violations)
        return bad or self.interrupted


def fault_events(log: Path) -> Counter[str]:
    """The head's structured fault events (logger appliance.events, a JSON object a line)
    counted by kind."""
    counts: Counter[str] = Counter()
    for line in log.read_text(errors="replace").splitlines():
        _, marker, data = line.partition(" appliance.events: ")
        if marker:
            with contextlib.suppress(json.JSONDecodeError):
                counts[str(json.loads(data).get("kind"))] += 1
    return counts


def table(report: Report) -> str:
    r, start, end = report.requests, report.start, report.end
    rows: list[tuple[str, object]] = [
        ("requests sent", r["sent"]),
        ("completed (the reference answer)", r["completed"]),
        ("failed cleanly (503 + Retry-After)", r["failed_cleanly"]),
        ("cancelled by their clients", r["cancelled"]),
        ("lost (must be 0)", r["lost"]),
        ("wrong answers (must be 0)", r["wrong"]),
        ("hangs (must be 0)", r["hang"]),
        ("other statuses (must be 0)", r["bad_status"]),
        ("invariant violations (must be 0)", len(report.violations)),
        ("interrupted before its bars", "yes" if report.interrupted else "no"),
    ]
    rows += [(f"fault: {k}", n) for k, n in sorted(report.faults.items())]
    rows += [(f"fault not applied: {k}", n) for k, n in sorted(report.faults_not_applied.items())]
    if report.events is not None:
        rows += [(f"appliance.events: {k}", n) for k, n in sorted(report.events.items())]
    if start and end:
        for name in ("blocks_in_use", "processes", "orphans", "fds", "rss_mb", "health"):
            rows.append((f"{name} start -> end", f"{getattr(start, name)} -> {getattr(end, name)}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{'':{width}}  value", f"{'-' * width}  -----"]
    lines += [f"{k:{width}}  {v}" for k, v in rows]
    return "\n".join(lines)
