"""The admin API called as the console calls it (the admin token from the server's token
file): the state snapshot and its pools, shared by the admin and autopilot tests."""

from __future__ import annotations

import httpx
from server_process import ServerProcess

from appliance.admin.schema import Snapshot

MOVE_BOUND_S = 240.0  # drain + stop + a new worker loading the model, on a busy machine


def admin_headers(server: ServerProcess) -> dict[str, str]:
    """The header that authorizes an admin call on `server`."""
    return {"Authorization": f"Bearer {server.admin_token_file.read_text()}"}


def snapshot(server: ServerProcess) -> Snapshot:
    """GET /admin/state, checked and parsed."""
    reply = httpx.get(server.url + "/admin/state", headers=admin_headers(server), timeout=10)
    assert reply.status_code == 200, reply.text
    return Snapshot.model_validate(reply.json())


def pools(snap: Snapshot) -> dict[str, list[int]]:
    """The devices of each pool, by pool name."""
    found: dict[str, list[int]] = {}
    for device in snap.devices:
        if device.pool is not None:
            found.setdefault(device.pool, []).append(device.index)
    return found
