"""The supervisor: a fork of the kernel in its own process group that starts the run's recorder
and its ranks, watches them, and records how the run ended."""
