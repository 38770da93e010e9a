"""The backends: what runs a step and owns its state behind one protocol (base.py's `Backend`:
forward/backward, gradients for the monitor, clipping, the optimizer step, the loss scale, the
state a checkpoint or a snapshot holds). `local` (one process, the reference), `fsdp` (FSDP2
over the mesh, with `torch_base` holding what both torch-native backends share) and `zero`
(DeepSpeed ZeRO 1/2/3, with `zero_state`: what a ZeRO rank holds where)."""
