"""The lab extension's TypeScript, run in Node (tests/extension_node.js): transpile
extension/src once per test module, then run one of the harness's scenarios and read its facts."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HARNESS = Path(__file__).parent / "extension_node.js"
SRC = ROOT / "extension" / "src"


def node() -> str:
    exe = shutil.which("node")
    if exe is None or not (ROOT / "extension" / "node_modules" / "typescript").exists():
        pytest.fail("node and extension/node_modules are needed: `make install` builds the "
                    "extension with them (Node.js >= 20.19)")
    return exe


def build(out: Path, src: Path = SRC) -> Path:
    subprocess.run([node(), str(HARNESS), "build", str(src), str(out)], check=True,
                   capture_output=True, text=True, timeout=120)
    return out


def run(out: Path, scenario: str, stdin: object = None, tz: str = "UTC") -> object:
    """The scenario's facts (JSON); fails with its stderr if it failed or printed nothing."""
    done = subprocess.run([node(), str(HARNESS), "run", str(out), scenario],
                          input=None if stdin is None else json.dumps(stdin),
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TZ": tz})
    assert done.returncode == 0 and done.stdout, \
        f"{scenario}: exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    return json.loads(done.stdout)
