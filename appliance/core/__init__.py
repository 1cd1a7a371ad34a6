"""Pure decisions on plain data: the request table, recovery, routing, restarts, tuning,
events. Imports no torch (tests/test_layers.py holds it)."""
