"""What observes a run, plugged into the loop's hooks (train/hooks.py) in the order the run's
assembly lists them (build.py `make_callbacks`): checkpoint cadence, evaluation and samples,
metrics and the console, the metric sinks, the profiler, fault drills, preemption, the hang
watchdog, straggler reports, INT8 calibration, mixture source events, the cost ledger. Callbacks
observe: what changes the run is the healer's (bigtrain/resilience), and a callback asks the
trainer through its methods (request_stop, record_start, use_ranges)."""
