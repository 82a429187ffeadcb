"""What runs in a rank, launched from a notebook or headless (torchrun, srun): the accelerator,
the run's controls, the notebook launch's entry (entry), the headless one (headless), the training
function's import address (address), and how a rank's outcome is recorded (outcome)."""
