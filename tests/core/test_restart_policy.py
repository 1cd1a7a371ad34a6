"""When crashed workers are started again, on plain data."""

from __future__ import annotations

from appliance.core.restart_policy import RestartPolicy


def test_backoff_doubles_with_recent_crashes_then_the_device_fails() -> None:
    policy = RestartPolicy(max_crashes=4, window_s=60, first_delay_s=0.5, max_delay_s=1.5)
    assert policy.on_crash(device=2, now=100.0) == 0.5
    assert policy.on_crash(device=2, now=101.0) == 1.0
    assert policy.on_crash(device=2, now=102.0) == 1.5  # capped
    assert policy.on_crash(device=2, now=103.0) is None  # 4 within a minute: failed


def test_old_crashes_are_forgiven_and_devices_are_counted_apart() -> None:
    policy = RestartPolicy(max_crashes=2, window_s=60, first_delay_s=1.0)
    assert policy.on_crash(device=0, now=0.0) == 1.0
    assert policy.on_crash(device=1, now=1.0) == 1.0  # another device's first crash
    assert policy.on_crash(device=0, now=61.0) == 1.0  # the first one fell out of the window
    assert policy.on_crash(device=0, now=62.0) is None
