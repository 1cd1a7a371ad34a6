"""The layout `serve` runs by default (planner.layout=auto): the one the planner ranks first
for the traffic the settings describe (planner.workload, rate, SLO) from this box's profile;
with no profile yet, a rule that starts at once (on CPUs every device colocated: each core
set prefills and decodes, which served chat 3x the split's goodput on a 2-core box; on GPUs
the planner's best on the analytic profile of the detected cards). A layout
the settings name (mode, a device list, a tensor-parallel degree, or planner.layout=manual)
is run as set."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from appliance.core.goodput import SLO
from appliance.model.model_source import default_model_path, prepare_model, prepare_tokenizer
from appliance.planner.analytic_box import box_profile
from appliance.planner.layout import Layout
from appliance.planner.plan import PlanSpec, make_plan
from appliance.planner.plan_memo import Choice, PlanMemo, code_digest, memo_key
from appliance.planner.profile import (
    Profile,
    load_profile,
    model_id,
    newest_profile,
    profiles_folder,
)
from appliance.planner.simulator import Policy, requests_from_workload
from appliance.settings.config import Settings, SettingsError
from appliance.topology.devices import Topology

log = logging.getLogger("appliance.planner")


# Settings that name a layout: any of them given keeps the default auto layout from
# replacing it (an explicit planner.layout=auto still does).
PINNING = (
    "mode",
    "prefill_devices",
    "decode_devices",
    "colocated_devices",
    "prefill_tp",
    "decode_tp",
)


def layout_pins(settings: Settings) -> tuple[str, ...]:
    """The settings that pin the layout; () when the planner chooses it."""
    if settings.planner.layout == "manual":
        return ("planner.layout=manual",)
    if "layout" in settings.planner.model_fields_set:
        return ()  # auto asked for by name: it replaces the layout settings
    return tuple(name for name in PINNING if name in settings.model_fields_set)


def moves_itself(settings: Settings) -> bool:
    """Whether the autopilot moves devices itself: planner.auto_rebalance as given by
    name; by default (on) only where the planner chooses the layout, so a layout the
    settings pin (every test and benchmark that names one) stays as set."""
    planner = settings.planner
    if "auto_rebalance" in planner.model_fields_set:
        return planner.auto_rebalance
    return planner.auto_rebalance and not layout_pins(settings)


def autopilot_resolved(settings: Settings) -> Settings:
    """`settings` with planner.auto_rebalance given as moves_itself decides it, before
    planning names the layout it runs (which would read as pinned)."""
    moves = moves_itself(settings)
    planner = settings.planner.model_copy(update={"auto_rebalance": moves})
    return settings.model_copy(update={"planner": planner})


def planned_settings(settings: Settings) -> Settings:
    """`settings` running the planned layout (mode, devices, TP; cpu_devices on a CPU
    box), or as they are where they pin the layout. Without a profile: the rule (see the
    module's docstring), unless planner.layout=auto was asked for by name, which needs a
    profile (SettingsError saying how to make one)."""
    pins = layout_pins(settings)
    if pins:
        log.info("layout: as set (%s)", ", ".join(pins))
        return settings
    from appliance.topology.discovery import discover_box

    topology = discover_box(settings.device, settings.cpu_devices, settings.cpu_share_cores)
    kind = box_kind(topology)
    found, _ = known_profile(settings, kind)
    if found is None and "layout" not in settings.planner.model_fields_set:
        return ruled_settings(settings, topology)
    profile = find_profile(settings, kind)
    choice, remembered = planned_choice(settings, profile)
    log.info(
        "layout auto: %s, the planner's best for %s at %s req/s (profile: %s%s)",
        choice.label,
        settings.planner.workload,
        settings.planner.rate,
        profile.key.device_kind,
        "; remembered from an earlier start" if remembered else "",
    )
    return settings.model_copy(update=choice.settings)


def planned_choice(settings: Settings, profile: Profile) -> tuple[Choice, bool]:
    """The planner's best layout for the settings on `profile`, and whether it was
    remembered (plan_memo.py) rather than ranked now."""
    # What ranks the layouts: the planner, the decisions it shares, the bench's workloads.
    package = Path(__file__).parent.parent
    code = code_digest((package / "planner", package / "core", package / "bench"))
    key = memo_key(
        profile.model_dump_json(),
        settings.planner.model_dump(),
        Policy.from_settings(settings),
        model_id(settings.model or default_model_path()),
        code,
    )
    memo = PlanMemo(settings.cache_dir / "plans")
    choice = memo.get(key)
    if choice is not None:
        return choice, True
    log.info("layout auto: ranking the layouts on this box's profile (kept for later starts)...")
    layout = best_layout(settings, profile)
    choice = Choice(layout.label, layout_settings(layout, profile))
    memo.put(key, choice)
    return choice, False


def ruled_settings(settings: Settings, topology: Topology | None = None) -> Settings:
    """The layout without a profile: colocated on every device of a CPU box; on GPUs the
    planner's best on the analytic profile of the detected cards (analytic_box.py), else,
    where there is none (a card without a datasheet preset, a mix of cards), the automatic
    split into prefill and decode pools. `topology`: the box (discovered when None)."""
    if topology is None:
        from appliance.topology.discovery import discover_box

        topology = discover_box(settings.device, settings.cpu_devices, settings.cpu_share_cores)
    model = model_id(settings.model or default_model_path())
    refine = f"`appliance profile` times this box for {model} so the planner can choose"
    if box_kind(topology) == "cpu":
        log.info("layout: colocated on every device (no profile yet: %s)", refine)
        return settings.model_copy(update={"mode": "colocated"})
    profile, about = analytic_base(settings, topology)
    if profile is None:
        log.info("layout: prefill and decode pools split (no profile yet, %s: %s)", about, refine)
        return settings
    layout = best_layout(settings, profile)
    log.info(
        "layout: %s, the planner's best for %s at %s req/s on %s (no profile yet: %s)",
        layout.label,
        settings.planner.workload,
        settings.planner.rate,
        about,
        refine,
    )
    return settings.model_copy(update=layout_settings(layout, profile))


def analytic_base(settings: Settings, topology: Topology) -> tuple[Profile | None, str]:
    """The analytic profile of the box's GPUs serving the settings' model, and what it is;
    (None, why not) where there is none."""
    config, _ = prepare_model(settings.model, settings.cache_dir)
    return box_profile(topology, config, model_id(settings.model or default_model_path()))


def box_kind(topology: Topology) -> str:
    """ "cpu" for a box of CPU devices, else "cuda": the kind of profile that plans it."""
    return "cpu" if all(device.kind == "cpu" for device in topology.devices) else "cuda"


def known_profile(settings: Settings, kind: str | None = None) -> tuple[Profile | None, Path]:
    """planner.profile, else the newest profile of this model on `kind` of device (any,
    when None; None: there is none), and where it is (or would be); ProfileError for a
    profile that cannot be read."""
    if settings.planner.profile is not None:
        return load_profile(settings.planner.profile), settings.planner.profile
    folder = profiles_folder(settings.cache_dir)
    found = newest_profile(folder, model_id(settings.model or default_model_path()), kind)
    return found, folder / (found.key.file_name() if found else "")


def find_profile(settings: Settings, kind: str | None = None) -> Profile:
    """planner.profile, else the newest profile of this model (on `kind` of device), else
    (when planner.profile_at_start) a new one; SettingsError saying what to do otherwise."""
    found, folder = known_profile(settings, kind)
    if found is not None:
        return found
    model = model_id(settings.model or default_model_path())
    if not settings.planner.profile_at_start:
        raise SettingsError(
            f"planner.layout=auto needs a profile of {model} and {folder} has none: run "
            "`appliance profile`, or set APPLIANCE_PLANNER__PROFILE_AT_START=true"
        )
    from appliance.planner.profile_cli import measure

    log.info("layout auto: no profile of %s yet; profiling this box first", model)
    profile = measure(settings)
    profile.save(folder)
    return profile


def best_layout(settings: Settings, profile: Profile) -> Layout:
    """The planner's first layout for the settings' workload, rate and SLO."""
    planner = settings.planner
    tokenizer = prepare_tokenizer(settings.model, settings.cache_dir)[1]
    requests = requests_from_workload(
        planner.workload, tokenizer, 0, planner.num_requests, rate=planner.rate
    )
    slo = SLO(ttft=planner.slo_ttft_ms / 1000, tpot=planner.slo_tpot_ms / 1000)
    spec = PlanSpec(rate=planner.rate, slo=slo, plot_best=0)
    plan = make_plan(profile, requests, spec, planner.workload, Policy.from_settings(settings))
    return plan.best.layout


def layout_settings(layout: Layout, profile: Profile) -> dict[str, Any]:
    """The settings that run `layout` on the profiled box."""
    values = layout.settings()
    if profile.key.device_kind.startswith("cpu"):
        values["cpu_devices"] = layout.cpu_devices(profile.atoms)
        values["device"] = "cpu"
    return values
