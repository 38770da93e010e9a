"""Context parallelism: one sequence split over the `cp` ranks of a model copy, and attention
across them (docs/context-parallel.md).

split.py      which tokens each cp rank holds (the chunks, their true positions), and the cut
              of a batch's inputs and targets; `ContextSplit` is what the model, the backend and
              the evaluator ask.
attention.py  attention over the whole sequence from a rank's chunk: `ring` (key/value blocks
              passed around the cp ranks, partial outputs merged by their log-sum-exp) and
              `all_to_all` (DeepSpeed-Ulysses: heads split, sequence gathered).
kernels.py    the attention kernels that return a log-sum-exp: the CPU flash kernel, and SDPA's
              flash and memory-efficient kernels on CUDA.
hf.py         the same attention in transformers' Llama-family models, through transformers'
              attention-function registry.
apply.py      `apply_context_parallel`: a built model pointed at its cp ranks (parallelize()).
"""
