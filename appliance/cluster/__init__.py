"""Boxes beyond the first: the head's listener, the agent on each other box, and the
workers an agent starts for the head."""
