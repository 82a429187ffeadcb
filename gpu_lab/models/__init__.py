"""gpu_lab.models — see DESIGN.md; filled in by its issue."""
