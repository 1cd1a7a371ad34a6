"""The asyncio pool parts of the supervisor: worker processes and their handles, the
request flow, handoffs, drains, boxes joining."""
