"""One way to split a box among workers: colocated workers, a prefill pool and a decode
pool, or (mixed) colocated workers beside the two pools; each worker spans `tp` devices
of `device_size` atoms (cores or GPUs). Pure data; `settings()` says how `appliance serve`
runs it. `layout_of_roles` builds one from each device's role."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from appliance.core.roles import ROLES
from appliance.planner.profile import worker_unit


class Pool(BaseModel):
    """`workers` workers of the same size (0 only in a mixed layout's prefill or decode
    pool)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workers: int = Field(ge=0)
    tp: int = Field(1, ge=1)


class Layout(BaseModel):
    """Where prompts go and who decodes them. Every device has `device_size` atoms.

    - colocated: `prefill` holds the colocated workers (each prefills and decodes what it
      prefilled); `decode` and `colocated` are None.
    - disaggregated: prompts to `prefill`, their KV handed to `decode` (both >= 1 worker);
      `colocated` is None.
    - mixed: `colocated` (>= 1 worker) beside `prefill` and `decode`, all three given, tp 1
      each; the split pools may have 0 workers but not both: the layout needs a worker
      that can decode (decode or colocated), and prefill workers need a decode worker to
      hand off to. A decode pool without prefill workers is allowed (it idles). E.g.
      `Layout(mode="mixed", prefill=Pool(workers=0), decode=Pool(workers=1),
      colocated=Pool(workers=1))` is "1D+1C".

    `cross_box`: a disaggregated layout over two boxes, the prefill pool on one and the
    decode pool on the other, so every handoff crosses the link between them
    (`Profile.network`); `devices` counts both boxes'."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["colocated", "disaggregated", "mixed"]
    device_size: int = Field(1, ge=1)
    prefill: Pool  # the colocated workers when mode is colocated
    decode: Pool | None = None
    colocated: Pool | None = None  # mixed mode only
    cross_box: bool = False  # disaggregated only: prefill on one box, decode on another

    @model_validator(mode="after")
    def _pools_match_mode(self) -> Layout:
        problem = self._problem()
        if problem is not None:
            raise ValueError(problem)
        return self

    def _problem(self) -> str | None:
        if self.cross_box and self.mode != "disaggregated":
            return "a cross-box layout is disaggregated: prefill on one box, decode on the other"
        if self.mode == "mixed":
            return self._mixed_problem()
        if (self.decode is None) != (self.mode == "colocated"):
            return "a decode pool is given exactly when the mode is disaggregated"
        if self.colocated is not None:
            return "a colocated pool is given only when the mode is mixed"
        if self.prefill.workers < 1 or (self.decode is not None and self.decode.workers < 1):
            return f"a {self.mode} layout needs at least one worker in each pool"
        return None

    def _mixed_problem(self) -> str | None:
        if self.decode is None or self.colocated is None:
            return "a mixed layout gives prefill, decode and colocated pools"
        if any(pool.tp != 1 for pool in (self.prefill, self.decode, self.colocated)):
            return "a mixed layout's workers have tp 1"
        if self.colocated.workers < 1:
            return "a mixed layout needs a colocated worker (else it is disaggregated)"
        if self.prefill.workers + self.decode.workers < 1:
            return "a mixed layout needs a prefill or decode worker (else it is colocated)"
        return _counts_problem(self.prefill.workers, self.decode.workers, self.colocated.workers)

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """As before mixed and cross-box layouts: no `colocated` key unless there is a
        colocated pool, no `cross_box` key unless it is set."""
        data: dict[str, Any] = handler(self)
        if self.colocated is None:
            data.pop("colocated", None)
        if not self.cross_box:
            data.pop("cross_box", None)
        return data

    def pools(self) -> tuple[Pool, ...]:
        """Every pool given, in device order (prefill, decode, colocated)."""
        return tuple(p for p in (self.prefill, self.decode, self.colocated) if p is not None)

    @property
    def devices(self) -> int:
        """Devices the layout uses."""
        return sum(pool.workers * pool.tp for pool in self.pools())

    @property
    def atoms(self) -> int:
        """Cores or GPUs the layout uses."""
        return self.devices * self.device_size

    @property
    def colocated_workers(self) -> int:
        """Workers that prefill and decode what they prefilled."""
        if self.mode == "colocated":
            return self.prefill.workers
        return self.colocated.workers if self.colocated is not None else 0

    @property
    def label(self) -> str:
        """Short and unique: 'colocated x2', '1P+1D', '2P(tp2)+4D', with '/2c' when each
        device has 2 cores (or GPUs); mixed: '1P+1D+1C', '1D+1C' (empty pools left out);
        cross-box: '[8P]+[4D(tp2)]', each box in brackets."""
        size = f"/{self.device_size}c" if self.device_size > 1 else ""
        if self.decode is None:
            return f"colocated x{self.prefill.workers}{_tp(self.prefill)}{size}"
        if self.cross_box:
            prefill, decode = self.prefill, self.decode
            return f"[{prefill.workers}P{_tp(prefill)}]+[{decode.workers}D{_tp(decode)}]{size}"
        parts = zip(self.pools(), "PDC", strict=False)
        named = [f"{pool.workers}{letter}{_tp(pool)}" for pool, letter in parts if pool.workers]
        return "+".join(named) + size

    def prefill_unit(self) -> str:
        return worker_unit(self.device_size, self.prefill.tp)

    def decode_unit(self) -> str:
        """The decode workers' size (the colocated workers' in colocated mode)."""
        return worker_unit(self.device_size, (self.decode or self.prefill).tp)

    def colocated_unit(self) -> str:
        """The colocated workers' size."""
        return worker_unit(self.device_size, (self.colocated or self.prefill).tp)

    def settings(self) -> dict[str, Any]:
        """The settings that make `appliance serve` run this layout on a box of these
        devices (on a CPU box also `cpu_devices`, see `cpu_devices`). Devices in order:
        prefill, decode, then (mixed, run as mode disaggregated) `colocated_devices`."""
        ranges = _device_ranges(self.pools())
        values: dict[str, Any] = {
            "mode": "disaggregated" if self.mode == "mixed" else self.mode,
            "prefill_tp": self.prefill.tp,
            "prefill_devices": ranges[0],
        }
        if self.decode is not None:
            values["decode_devices"] = ranges[1]
            values["decode_tp"] = self.decode.tp
        if self.colocated is not None:
            values["colocated_devices"] = ranges[2]
        return values

    def cpu_devices(self, cores: int) -> int:
        """On a CPU box of `cores` cores: how many devices to split it into so each has
        `device_size` cores."""
        if cores % self.device_size:
            raise ValueError(f"{cores} cores do not split into devices of {self.device_size}")
        return cores // self.device_size


def layout_of_roles(roles: Sequence[str | None], device_size: int = 1) -> Layout:
    """The layout of one worker (tp 1) per device with a role ("prefill", "decode",
    "colocated"; None: no worker there): colocated when every worker is, disaggregated
    when none is, else mixed. ValueError saying why for a set of roles that cannot
    serve (see `roles_problem`)."""
    problem = roles_problem(roles)
    if problem is not None:
        raise ValueError(f"roles {tuple(roles)}: {problem}")
    prefill, decode, colocated = (sum(1 for r in roles if r == role) for role in ROLES)
    if not prefill and not decode:
        return Layout(mode="colocated", device_size=device_size, prefill=Pool(workers=colocated))
    return Layout(
        mode="mixed" if colocated else "disaggregated",
        device_size=device_size,
        prefill=Pool(workers=prefill),
        decode=Pool(workers=decode),
        colocated=Pool(workers=colocated) if colocated else None,
    )


def roles_problem(roles: Sequence[str | None]) -> str | None:
    """Why devices with these roles cannot serve, in one line; None when they can."""
    for device, role in enumerate(roles):
        if role is not None and role not in ROLES:
            return f"device {device} has role {role!r}, not one of {', '.join(ROLES)}"
    prefill, decode, colocated = (sum(1 for r in roles if r == role) for role in ROLES)
    return _counts_problem(prefill, decode, colocated)


def _counts_problem(prefill: int, decode: int, colocated: int) -> str | None:
    if not prefill and not colocated:
        return "no worker can prefill"
    if not decode and not colocated:
        return "no worker can decode"
    if prefill and not decode:
        return "prefill workers need a decode worker to hand off to"
    return None


def _device_ranges(pools: Sequence[Pool]) -> list[tuple[int, ...]]:
    """Each pool's devices, numbered on from the pool before it."""
    ranges, first = [], 0
    for pool in pools:
        count = pool.workers * pool.tp
        ranges.append(tuple(range(first, first + count)))
        first += count
    return ranges


def _tp(pool: Pool) -> str:
    return f"(tp{pool.tp})" if pool.tp > 1 else ""
