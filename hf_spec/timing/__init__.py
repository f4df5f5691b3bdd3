"""Timing on this machine, kept apart from the sizers that read it (`hf_spec.sizing` runs no model):

- `probe`: the cost probe, which times target and draft passes (`probe_costs`, `measure_costs`, `forward_seconds`),
  seeds and corrects its tables, and `synchronize` for an honest clock on an accelerator;
- `store`: the probe's tables and the kernel choices kept on disk per machine, models and kernels;
- `load`: whether other processes kept the CPUs busy while something was timed.
"""
