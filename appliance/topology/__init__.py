"""The box's devices, how they are linked, and how they split into prefill/decode pools.

- devices.py: the plain data (`Device`, `Link`, `Topology`) and `DeviceError`.
- discovery.py: `discover`, the devices for the `device` setting: GPUs or CPU core sets.
- nvml.py: the GPUs and their links as NVML reports them.
- cuda_order.py: which GPU each torch ordinal is (CUDA_VISIBLE_DEVICES), and torch's check.
- cpu.py: CPU devices as core sets, and pinning a worker to its cores.
- partition.py: the prefill/decode pools, decode-to-prefill pairs and TP groups (pure).

Nothing is re-exported here: import from the module that does the job.
"""
