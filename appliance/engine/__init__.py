"""Scheduling, model execution and sampling for one worker's sequences."""
