"""The facts the lab extension shares with gpu_lab (the run statuses, the points a run view opens
with, the mean's series key, the telemetry history's length) have one home: Python. The extension
reads them from extension/src/facts.ts, which extension/make_facts.py generates from that home;
these fail when the committed file and Python disagree, or when the TypeScript writes one again."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAKE = ROOT / "extension" / "make_facts.py"
SRC = ROOT / "extension" / "src"
STATUSES = "pending|running|stopping|succeeded|failed|stopped|lost"


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)


def test_facts_ts_is_what_python_generates():
    out = _python(f"import runpy, sys; sys.argv = [{str(MAKE)!r}, '--check']; "
                  f"runpy.run_path({str(MAKE)!r}, run_name='__main__')")
    assert out.returncode == 0, (f"extension/src/facts.ts is out of date; run "
                                 f"`python extension/make_facts.py`:\n{out.stdout}{out.stderr}")


def test_the_check_fails_when_python_changes():
    """A status added in Python and not in facts.ts is caught (the check above can fail)."""
    out = _python("from gpu_lab.record import events; "
                  "events.ACTIVE_STATUSES = events.ACTIVE_STATUSES + ('paused',); "
                  f"import runpy, sys; sys.argv = [{str(MAKE)!r}, '--check']; "
                  f"runpy.run_path({str(MAKE)!r}, run_name='__main__')")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "+export const ACTIVE_STATUSES = ['pending', 'queued', 'running', 'stopping', 'paused']" \
        in out.stdout


def test_facts_hold_the_python_values():
    from gpu_lab.record import events
    from gpu_lab.server import hub, runview

    text = (SRC / "facts.ts").read_text()
    assert re.findall(r"'(\w+)'", text.split("ACTIVE_STATUSES = ")[1].split("\n")[0]) == \
        list(events.ACTIVE_STATUSES)
    assert re.findall(r"'(\w+)'", text.split("FINAL_STATUSES = ")[1].split("\n")[0]) == \
        list(events.FINAL_STATUSES)
    assert f"DEFAULT_POINTS = {runview.DEFAULT_POINTS};" in text
    assert f"MAX_COMPARE = {runview.MAX_COMPARE};" in text
    assert f"MEAN = '{runview.MEAN}';" in text
    assert f"MAX_TELEMETRY_HISTORY = {hub.MAX_HISTORY};" in text


def test_the_typescript_writes_no_second_copy():
    """Outside facts.ts: no list or union of statuses, no numeric points or history default, no
    MEAN of its own."""
    rules = {
        "a list of run statuses": rf"'({STATUSES})'\s*[,|]\s*'({STATUSES})'",
        "a numeric points default": r"\bpoints\s*=\s*\d",
        "a numeric count for the server": r"\b(getRun|compare|telemetryHistory)\([^)]*\b\d{2,}\b",
        "a MEAN of its own": r"\bMEAN\s*=",
        "a status type of its own": r"\btype\s+RunStatus\s*=",
    }
    bad = []
    for path in sorted(SRC.glob("*.ts")):
        if path.name == "facts.ts":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            bad += [f"{path.name}:{n}: {what}: {line.strip()}" for what, rx in rules.items()
                    if re.search(rx, line)]
    assert not bad, "\n".join(bad)
