"""The GPU gate: NVML readings of a node's GPUs, judged against the site's policy.

alloc.py    Slurm's allocation (SLURM_JOB_GPUS, CUDA_VISIBLE_DEVICES), parsed strictly
probe.py    NVML readings, one per GPU (the gate's one user of pynvml; doctor
            loads it apart, only to say why it cannot)
xid.py      critical XIDs from the kernel log, with a cursor per GPU
verdict.py  readings + policy -> findings (pure)
drain.py    scontrol: drain with a ``tfimage:`` reason; resume only those
gate.py     the prolog's check and baseline, and ``tfimage gpu check``
"""
