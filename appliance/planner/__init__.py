"""Profile, simulate, plan: the appliance predicts its own latency and picks the pool
layout. `profile` holds a box's step costs (measured by `profiler`, or `analytic`),
`layout` names one way to split the box, `simulator` replays a workload on a layout
with a profile, and `plan` ranks the layouts. Everything but `profiler` is torch-free."""
