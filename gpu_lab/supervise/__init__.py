"""The supervisor: a fork of the kernel in its own process group that starts the run's recorder
and its ranks, watches them, and records how the run ended (supervisor, multinode); and ending a
run's process tree from outside it (kill: Run.stop, stop_run)."""
