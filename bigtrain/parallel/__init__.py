"""Parallelism: where this process sits (env.py), the one parallel Layout of the run (layout.py:
every dimension's size, this rank's coordinates, the DeviceMesh), where the model is built
(model_setup.py, meta_init.py) and the one `parallelize()` that turns a built model into a trained
one (parallelize.py: pipeline split, tensor parallelism, context parallelism, experts, activation
checkpointing and compile from transforms.py, FSDP2 or DeepSpeed). One subpackage per subject:
backends/ (the step and its state behind one protocol), tensor/ (tensor-parallel plans),
context/ (the sequence split over cp ranks and attention across them), pipeline/ (stages and
their schedule), replicas/ (torchft replica groups); experts.py places each MoE layer's
experts."""
