"""gpu_lab.export — see DESIGN.md; filled in by its issue."""
