"""gpu_lab.telemetry — see DESIGN.md; filled in by its issue."""
