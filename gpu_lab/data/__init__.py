"""gpu_lab.data — see DESIGN.md; filled in by its issue."""
