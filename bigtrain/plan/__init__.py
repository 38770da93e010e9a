"""The planner, `bigtrain plan`: what a config will cost before anything runs.

shapes.py          the model on the meta device: its size, largest block and activation shape
comm.py            what tensor parallelism splits, and the bytes each mesh axis moves per step
footprint.py       bytes per parameter by component, activations per token; the planned run
                   (PlannedRun: the config at a world size, with the same Layout a run of it
                   builds, so a plan and a run cannot disagree on the sizes)
experts.py         mixture of experts: total and active parameters, the all-to-all
stages.py          each GPU's states, transient weights and activations (rank_loads: the one
                   account every section reads, checkpoint bytes per GPU), pipeline stages
step_time.py       the modelled step time (compute, bubble, collectives) and the traffic per rank
proposal.py        `bigtrain plan --propose`: the layouts of a world size, the one proposed
text.py            `bigtrain plan`'s table
simulation.py      the goodput model: failures and their costs over a long run (Monte Carlo)
goodput_inputs.py  its inputs with where each came from (defaults, config, a run, --set)
goodput.py         `bigtrain plan --goodput`: the simulation at a size, the best interval
"""
