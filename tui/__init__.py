"""The appliance's console: a Textual app that shows the admin API's snapshots and sends
its pool moves and tuning changes.

`tui.client` needs only httpx and pydantic; `tui.app` (and Textual) load only when the
console runs.
"""
