"""What a run reports about itself: MFU, memory peaks and the out-of-memory report, the profiler
window and the loop's phase ranges, the metric sinks (wandb, TensorBoard, MLflow), the kept
trajectory, the report and the costs a run measured (costs.py, read by the goodput plan).
(The gradient monitor inside the step, whose numbers the healer judges, is bigtrain/monitor.)"""
