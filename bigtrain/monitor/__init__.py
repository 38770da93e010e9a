"""The gradient monitor inside the step: one fused pass over this rank's gradient shards (a
Triton kernel on CUDA, torch elsewhere: kernel.py, stats.py), reduced over the ranks the layout
names in one small collective, read to the host once per step (monitor.py). Its numbers are what
the healer (bigtrain/resilience) judges. What a run reports about itself is bigtrain/telemetry."""
