"""The pieces of boxes beyond the first that need no second process: a joining box's
devices in the topology, the addresses and the shared secret the settings name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.cluster.channel import SecretError, read_secret
from appliance.cluster.interfaces import interface_of, with_interface
from appliance.core.router import Router
from appliance.settings.cluster import ClusterSettings, host_port
from appliance.settings.config import SettingsError, load_settings, parse_devices
from appliance.topology.devices import Device, Topology
from appliance.topology.partition import partition


def cpu(index: int, cores: tuple[int, ...]) -> Device:
    return Device("cpu", index, f"cpu{index}", 0, 0, cores=cores)


def test_a_joining_box_adds_its_devices_after_the_heads_linked_over_the_network() -> None:
    head = Topology.without_links([cpu(0, (0,)), cpu(1, (1,))])
    both = head.with_box("b", [cpu(0, (0, 1)), cpu(1, (2, 3))])
    assert [(d.index, d.box, d.cores) for d in both.devices] == [
        (0, "", (0,)),
        (1, "", (1,)),
        (2, "b", (0, 1)),  # its own cores, numbered on its own box
        (3, "b", (2, 3)),
    ]
    assert both.links[0][1].kind == "none" and both.links[2][3].kind == "none"
    assert both.links[1][2].kind == "network" == both.links[3][0].kind
    assert both.bandwidth_rank(2, 3) > both.bandwidth_rank(1, 2)  # in a box beats across
    with pytest.raises(ValueError, match="box 'b' is in the topology already"):
        both.with_box("b", [cpu(0, (0,))])


def test_handoffs_prefer_a_decode_worker_in_the_prefill_workers_box() -> None:
    topology = Topology.without_links([cpu(0, (0,))]).with_box("b", [cpu(0, (0,))])
    router = Router(16, False, topology.bandwidth_rank)
    assert router.link_rank(0, 0) > router.link_rank(0, 1)


def test_addresses_are_host_and_port() -> None:
    assert host_port("10.0.0.1:7400") == ("10.0.0.1", 7400)
    assert host_port("[::1]:7400") == ("::1", 7400)
    for bad in ("10.0.0.1", "10.0.0.1:", ":7400", "host:99999", "host:port"):
        with pytest.raises(ValueError, match="expected host:port"):
            host_port(bad)
    with pytest.raises(SettingsError, match="host:port"):
        load_settings(cluster={"listen": "nowhere", "secret_file": "s"})
    with pytest.raises(SettingsError, match=r"need cluster\.secret_file"):
        load_settings(cluster={"listen": "127.0.0.1:7400"})
    assert ClusterSettings().listen == ""  # no other boxes unless asked


def test_the_secret_must_be_given_readable_and_long_enough(tmp_path: Path) -> None:
    with pytest.raises(SecretError, match="secret_file is not set"):
        read_secret(None)
    with pytest.raises(SecretError, match="cannot read"):
        read_secret(tmp_path / "missing")
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(SecretError, match="shorter than 16 bytes"):
        read_secret(short)
    good = tmp_path / "good"
    good.write_text("  0123456789abcdef0123\n")
    assert read_secret(good) == b"0123456789abcdef0123"


def test_the_kv_transfer_listens_on_the_interface_the_boxes_talk_over() -> None:
    loopback = interface_of("127.0.0.1")
    assert loopback is not None and interface_of("127.0.0.2") == loopback
    assert interface_of("203.0.113.9") is None  # not this machine's
    assert interface_of("head.example") is None
    assert with_interface(ClusterSettings(), "127.0.0.1").interface == loopback
    assert with_interface(ClusterSettings(interface="eth1"), "127.0.0.1").interface == "eth1"
    assert with_interface(ClusterSettings(), "0.0.0.0").interface == ""  # UCX's choice


def test_a_head_may_leave_decoding_to_other_boxes() -> None:
    head = Topology.without_links([cpu(0, (0,)), cpu(1, (1,))])
    assert parse_devices("none") == ()
    only_prefill = partition(head, "disaggregated", None, (), boxes=True)
    assert only_prefill.prefill == (0, 1) and only_prefill.decode == ()
    one = Topology.without_links([cpu(0, (0,))])
    assert partition(one, "disaggregated", (0,), (), boxes=True).prefill == (0,)
    with pytest.raises(ValueError, match="at least 2 devices"):  # no boxes: it must decode
        partition(one, "disaggregated", (0,), ())
    with pytest.raises(SettingsError, match="hands KV off only within its own box"):
        load_settings(decode_devices="none", prefill_tp=2)


HIDE_NIXL = "import sys\nfor m in ('nixl', 'nixl_cu12', 'nixl_cu13'): sys.modules[m] = None\n"


@pytest.mark.process  # the slow lane: runs the command in a process of its own
@pytest.mark.parametrize(
    "command",
    [
        ["agent", "--head", "127.0.0.1:1", "--box", "b"],
        ["serve", "--port", "1"],  # listening for boxes
    ],
)
def test_a_box_without_nixl_is_refused_before_any_worker_starts(
    command: list[str], tmp_path: Path
) -> None:
    secret = tmp_path / "secret"
    secret.write_text("a-shared-secret-of-the-test-boxes\n")
    env = {
        **os.environ,
        "APPLIANCE_CLUSTER__SECRET_FILE": str(secret),
        "APPLIANCE_CLUSTER__LISTEN": "127.0.0.1:1" if command[0] == "serve" else "",
    }
    script = HIDE_NIXL + f"from appliance.cli import main\nsys.exit(main({command!r}))\n"
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == (78 if command[0] == "agent" else 2), run.stderr
    assert "boxes move KV through NIXL, which is not installed here" in run.stderr
    assert "worker" not in run.stderr.lower()
