"""One way to split a box among workers: colocated workers, or a prefill pool and a decode
pool, each worker spanning `tp` devices of `device_size` atoms (cores or GPUs). Pure data;
`settings()` says how `appliance serve` runs it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from appliance.planner.profile import worker_unit


class Pool(BaseModel):
    """`workers` workers of the same size."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workers: int = Field(ge=1)
    tp: int = Field(1, ge=1)


class Layout(BaseModel):
    """Colocated (`decode` is None: every worker prefills and decodes what it prefilled) or
    disaggregated (prompts to `prefill`, their KV handed to `decode`). Every device has
    `device_size` atoms."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["colocated", "disaggregated"]
    device_size: int = Field(1, ge=1)
    prefill: Pool  # the colocated workers when mode is colocated
    decode: Pool | None = None

    @model_validator(mode="after")
    def _pools_match_mode(self) -> Layout:
        if (self.decode is None) != (self.mode == "colocated"):
            raise ValueError("a decode pool is given exactly when the mode is disaggregated")
        return self

    @property
    def devices(self) -> int:
        """Devices the layout uses."""
        used = self.prefill.workers * self.prefill.tp
        return used + (self.decode.workers * self.decode.tp if self.decode else 0)

    @property
    def atoms(self) -> int:
        """Cores or GPUs the layout uses."""
        return self.devices * self.device_size

    @property
    def label(self) -> str:
        """Short and unique: 'colocated x2', '1P+1D', '2P(tp2)+4D', with '/2c' when each
        device has 2 cores (or GPUs)."""
        size = f"/{self.device_size}c" if self.device_size > 1 else ""
        if self.decode is None:
            return f"colocated x{self.prefill.workers}{_tp(self.prefill)}{size}"
        prefill = f"{self.prefill.workers}P{_tp(self.prefill)}"
        return f"{prefill}+{self.decode.workers}D{_tp(self.decode)}{size}"

    def prefill_unit(self) -> str:
        return worker_unit(self.device_size, self.prefill.tp)

    def decode_unit(self) -> str:
        """The decode workers' size (the colocated workers' in colocated mode)."""
        return worker_unit(self.device_size, (self.decode or self.prefill).tp)

    def settings(self) -> dict[str, Any]:
        """The settings that make `appliance serve` run this layout on a box of these
        devices (on a CPU box also `cpu_devices`, see `cpu_devices`)."""
        prefill_devices = tuple(range(self.prefill.workers * self.prefill.tp))
        values: dict[str, Any] = {
            "mode": self.mode,
            "prefill_tp": self.prefill.tp,
            "prefill_devices": prefill_devices,
        }
        if self.decode is not None:
            first = len(prefill_devices)
            values["decode_devices"] = tuple(
                range(first, first + self.decode.workers * self.decode.tp)
            )
            values["decode_tp"] = self.decode.tp
        return values

    def cpu_devices(self, cores: int) -> int:
        """On a CPU box of `cores` cores: how many devices to split it into so each has
        `device_size` cores."""
        if cores % self.device_size:
            raise ValueError(f"{cores} cores do not split into devices of {self.device_size}")
        return cores // self.device_size


def _tp(pool: Pool) -> str:
    return f"(tp{pool.tp})" if pool.tp > 1 else ""
