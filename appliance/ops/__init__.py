"""Operator actions on running pools: moves between roles, the traffic window, the autopilot."""
