"""gpu_lab.train — see DESIGN.md; filled in by its issue."""
