"""Launching and faults: where the ranks come from (self-launch, torchrun, srun) and preemption by SIGTERM."""
