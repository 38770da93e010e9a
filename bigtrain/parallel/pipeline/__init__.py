"""Pipeline stages: where a model splits and each stage's part of it (split.py), the schedule
that runs this rank's chunks with torch.distributed.pipelining (schedule.py), and the local and
FSDP2 backends over a stage's chunks (stage_backends.py). The planner's view of the same stages
is bigtrain/plan/stages.py."""
