"""gpu_lab.widgets — see DESIGN.md; filled in by its issue."""
