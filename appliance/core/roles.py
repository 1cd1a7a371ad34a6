"""The roles a worker takes, one vocabulary for every part: prefill (prompts to their first
token, then hand off), decode (handed-off requests to their end), colocated (both)."""

from __future__ import annotations

from typing import Literal, get_args

Role = Literal["prefill", "decode", "colocated"]
ROLES: tuple[Role, ...] = get_args(Role)
ENTRY_ROLES: tuple[Role, ...] = ("prefill", "colocated")  # the roles that take new prompts
