"""Training code as users bring it (never importing gpu_lab): scripts that tests launch."""
