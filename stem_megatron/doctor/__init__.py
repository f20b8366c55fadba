"""``stem-doctor``: the first command to run on a new machine or GPU node (docs/gpu.md).

It checks the environment the training runs need (``checks``: versions, CUDA, NCCL, Transformer Engine,
DeepSpeed's CPU Adam op, pinned memory, /dev/shm), then trains the tiny model on the CPU and, where there are GPUs,
on them from the same weights and compares the losses (``training``). ``job_start`` is the part of it that
``slurm/_launch.sh`` runs at the start of every GPU job.
"""
