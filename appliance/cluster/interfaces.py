"""Which network interface the KV transfer listens on when the settings do not name one:
the one holding the address the boxes already talk over (the head's listen address, or
the address an agent reaches the head from), so nothing listens beyond it."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

from appliance.settings.cluster import ClusterSettings

SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_of(ip: str) -> str | None:
    """The name of the interface holding IPv4 address `ip` (the loopback interface for
    any 127.x address), or None (not an address of this machine's, or not IPv4)."""
    try:
        loopback = ipaddress.ip_address(ip).is_loopback
    except ValueError:  # a host name
        return None
    for name, address in _addresses():
        if address == ip or (loopback and ipaddress.ip_address(address).is_loopback):
            return name
    return None


def _addresses() -> list[tuple[str, str]]:
    """(interface, IPv4 address) for each interface that has one."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on it
                continue
            found.append((name, socket.inet_ntoa(reply[20:24])))
    return found


def with_interface(settings: ClusterSettings, ip: str) -> ClusterSettings:
    """The settings with the interface of `ip` for the KV transfer, unless they name one
    (or `ip` is on no interface, e.g. a wildcard: then UCX's own choice stands)."""
    if settings.interface:
        return settings
    name = interface_of(ip)
    return settings if name is None else settings.model_copy(update={"interface": name})
