"""Why a run failed: a rank's failure (triage: its category) and the explanation a user can act
on (explain). A leaf: it imports nothing else from gpu_lab."""
