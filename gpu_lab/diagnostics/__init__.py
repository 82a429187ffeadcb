"""gpu_lab.diagnostics — see DESIGN.md; filled in by its issue."""
