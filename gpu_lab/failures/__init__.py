"""Why a run failed: what a failure is (kinds: its categories, RankFailure), how a rank's failure
is made and ordered (triage), what its message means (explain) and what to try after an out of
memory (oom). The bottom of the package stack: it imports only gpu_lab's leaf tables (units,
hardware), so every layer above may report a failure."""
