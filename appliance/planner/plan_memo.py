"""The auto layout's choice remembered between starts: ranking the layouts simulates each
one on the planner's workload (about 10 s on a 2-core CPU), and `serve` would pay that at
every start on a profiled box for the same answer. A choice is kept under a key of
everything it depends on: the profile's content, the planner settings that describe the
traffic, the scheduling policy, the model, and the planner's own code (its source files),
so a new profile, other settings or an upgrade plans again. Torch-free."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("appliance.planner")

TRAFFIC_FIELDS = ("workload", "rate", "slo_ttft_ms", "slo_tpot_ms", "num_requests")
"""The planner settings that change which layout ranks first."""


@dataclass(frozen=True)
class Choice:
    """A planned layout: its label (for the log) and the settings that run it."""

    label: str
    settings: dict[str, Any]


def memo_key(
    profile_json: str, planner: dict[str, Any], policy: object, model: str, code: str
) -> str:
    """The key of one planning question (the arguments: see the module docstring;
    `policy` a dataclass, `code` code_digest())."""
    question = {
        "profile": profile_json,
        "planner": {name: planner[name] for name in TRAFFIC_FIELDS},
        "policy": asdict(policy),  # type: ignore[call-overload]
        "model": model,
        "code": code,
    }
    text = json.dumps(question, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def code_digest(folders: tuple[Path, ...]) -> str:
    """A digest of the Python sources under `folders`: what ranks layouts, so a changed
    simulator never answers from a choice its old code made."""
    digest = hashlib.blake2b(digest_size=12)
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            digest.update(path.relative_to(folder).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


class PlanMemo:
    """Choices kept as `<folder>/<key>.json`, one small file each."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def get(self, key: str) -> Choice | None:
        """The choice kept under `key`; None when there is none or it cannot be read
        (then the planner runs again and overwrites it)."""
        path = self.folder / f"{key}.json"
        try:
            data = json.loads(path.read_text())
            # JSON kept the device tuples as lists; the settings are given them as made.
            items = data["settings"].items()
            values = {k: tuple(v) if isinstance(v, list) else v for k, v in items}
            return Choice(str(data["label"]), values)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("the remembered layout %s is unreadable (%s): planning again", path, exc)
            return None

    def put(self, key: str, choice: Choice) -> None:
        """Keep `choice` under `key` (written whole, then renamed: a reader never sees
        half a file). A folder that cannot be written only costs the next start a plan."""
        path = self.folder / f"{key}.json"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"label": choice.label, "settings": choice.settings}))
            tmp.replace(path)
        except OSError as exc:
            log.warning("could not keep the planned layout in %s: %s", self.folder, exc)
