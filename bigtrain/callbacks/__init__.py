"""Everything that plugs into the loop through its hooks (train/hooks.py): anomaly guard, rollback,
checkpoints, evaluation, metrics and console, wandb, fault drills, preemption, the hang watchdog,
straggler reports, INT8 calibration."""
