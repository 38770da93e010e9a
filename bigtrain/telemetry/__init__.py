"""What a run reports about itself: MFU, memory peaks, the profiler window, the metric sinks, the
kept trajectory, the report and the goodput simulation. (The gradient monitor inside the step,
whose numbers the healer judges, is `bigtrain/monitor/`.)"""
