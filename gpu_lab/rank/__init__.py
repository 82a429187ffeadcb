"""What runs in a rank, launched from a notebook or headless (torchrun, srun): the accelerator,
the run's controls, and how a rank's outcome is recorded."""
