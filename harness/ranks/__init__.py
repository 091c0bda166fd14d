"""Stage 2, ranks: where a case runs: the placement rule (``placement``), the GPU slots
xdist workers' NCCL ranks share (``gpu_slots``), the persistent rank processes and
their watchdog (``pool``, ``rank_process``, ``rank``, ``stacks``), the forkserver CPU ranks fork from
(``forkserver``) and torchrun's ranks (``torchrun_watch``, ``torchrun_world``).
"""
