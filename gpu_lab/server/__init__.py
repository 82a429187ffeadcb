"""gpu_lab.server — see DESIGN.md; filled in by its issue."""
