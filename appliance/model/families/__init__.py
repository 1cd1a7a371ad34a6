"""One file per model family: its config reader, its layer choices and weight names, the
model it builds. appliance/model/registry.py maps architecture names to them."""
