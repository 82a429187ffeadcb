"""gpu_lab.cluster.slurm's calls of Slurm's client commands, with a stand-in command on PATH."""
from __future__ import annotations

import pytest

from gpu_lab.cluster import slurm

pytestmark = pytest.mark.slow  # starts a stand-in scontrol (bash), if only for milliseconds


def _scontrol(tmp_path, monkeypatch, body: str) -> None:
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    exe = bin_ / "scontrol"
    exe.write_text("#!/bin/bash\n" + body)
    exe.chmod(0o700)
    monkeypatch.setenv("PATH", f"{bin_}:/usr/bin:/bin")


def test_a_command_killed_by_the_jobs_sigterm_is_asked_again(tmp_path, monkeypatch):
    # a job that loses a node is cancelled by Slurm, whose SIGTERM reaches the scontrol its
    # supervisor runs to name the node (a two-node test saw "scontrol show failed (exit -15)")
    marker = tmp_path / "killed-once"
    _scontrol(tmp_path, monkeypatch, f'[ -e {marker} ] || {{ touch {marker}; kill -TERM $$; }}\n'
                                     'echo n1; echo n2\n')
    assert slurm.hostnames("n[1-2]") == ["n1", "n2"]
    assert marker.exists()


def test_a_command_killed_twice_is_a_clear_error(tmp_path, monkeypatch):
    _scontrol(tmp_path, monkeypatch, "kill -TERM $$\n")
    with pytest.raises(slurm.SlurmError, match=r"scontrol show failed \(exit -15\)"):
        slurm.hostnames("n[1-2]")


def test_an_order_killed_by_a_signal_is_not_given_twice(tmp_path, monkeypatch):
    # sbatch may have submitted before the signal: a second call could queue the job twice
    count = tmp_path / "calls"
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    exe = bin_ / "sbatch"
    exe.write_text(f"#!/bin/bash\necho x >> {count}\nkill -TERM $$\n")
    exe.chmod(0o700)
    monkeypatch.setenv("PATH", f"{bin_}:/usr/bin:/bin")
    with pytest.raises(slurm.SlurmError, match=r"sbatch .* failed \(exit -15\)"):
        slurm.sbatch(str(tmp_path / "job.sh"))
    assert count.read_text().splitlines() == ["x"]
