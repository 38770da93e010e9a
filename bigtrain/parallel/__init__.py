"""Parallelism: where this process sits (env.py), the one parallel Layout of the run (layout.py:
every dimension's size, this rank's coordinates, the DeviceMesh), where the model is built
(model_setup.py, meta_init.py), one `parallelize` that applies tensor parallelism, activation
checkpointing, compile and FSDP2 or DeepSpeed (parallelize.py, tensor_parallel.py, tp_conv1d.py,
apply.py), the backends behind one protocol (backend.py; local, FSDP2, ZeRO), and fault-tolerant
replica groups on torchft (ft.py)."""
