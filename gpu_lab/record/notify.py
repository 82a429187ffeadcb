"""Notices when a run ends, through apprise: e-mail, Slack, Telegram, Matrix, ntfy, webhooks, ...

Nothing is sent unless URLs are configured; the first of these that is given wins:
  1. `launch(..., notify="json://host/hook")` (or a list of URLs) for that run; `notify=""` or
     `[]` sends nothing for it, whatever the settings below say;
  2. the environment variable GPU_LAB_NOTIFY: apprise URLs separated by spaces or commas;
  3. the file `$GPU_LAB_HOME/notify.txt`: one URL per line, `#` starts a comment.
Every URL is checked (by apprise, offline) before the run starts: a bad one is refused with
apprise's reason. `python -m gpu_lab.rank.headless` checks 2 and 3 the same way (exit code 2).

The notice: title "gpu_lab: <name> <status>"; body: name, id, status and duration, the host, then
the triage's first line (failed), or the reason (stopped, lost), and the last step.

When, and the promise that it never holds up or breaks the run's end:
- a launched run: its recorder, once it has written the final status in the registry (whatever it
  is: succeeded, failed, stopped, or lost when the supervisor died without a word), starts a sender
  in a session of its own (`python -m gpu_lab.record.notify`) and exits without waiting for it;
  `run.wait()` in the kernel never waits for a notice. The URLs wait in the run folder's
  notify.json (mode 0600 whatever the share group: URLs carry credentials), removed once read.
- a headless run: global rank 0 sends in its own process once it has closed the row (a job's
  processes may not outlive it), with the row as it stands then.
Each URL gets apprise's socket timeouts, the whole send at most SEND_TIMEOUT_S; no exception
leaves this module. One line in the run's log (logs/supervisor.log; rank 0's stderr when headless)
says to how many URLs the notice went, and why each other one failed.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Sequence, TextIO

from .runfolder import RunFolder

ENV = "GPU_LAB_NOTIFY"
FILE_NAME = "notify.txt"  # in GPU_LAB_HOME
SEND_TIMEOUT_S = 30.0
# apprise's notification types, by how a run ended
KINDS = {"succeeded": "success", "failed": "failure", "stopped": "info", "pruned": "info",
         "lost": "warning"}
EXAMPLES = ("json://host:port/path (a webhook), mailto://user:password@example.com, "
            "ntfy://topic, slack://TokenA/TokenB/TokenC, tgram://bottoken/chat_id")


# --- configuration ---------------------------------------------------------------------------------
def resolve(notify: str | Sequence[str] | None) -> list[str]:
    """The URLs a launch notifies: `notify` when given (checked), else the settings'."""
    return configured() if notify is None else check(notify, "launch: notify")


def configured() -> list[str]:
    """The URLs of GPU_LAB_NOTIFY, else of $GPU_LAB_HOME/notify.txt, checked; [] when neither."""
    raw = os.environ.get(ENV, "")
    if raw.strip():
        return check(raw, ENV)
    from .registry import home

    path = home() / FILE_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the notification URLs ({exc})") from None
    urls = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    return check([u for u in urls if u], str(path))


def check(value: Any, where: str) -> list[str]:
    """`value` (a string of URLs separated by spaces or commas, or a list of URLs) as a list of
    URLs that apprise can use; otherwise a ValueError naming the URL and apprise's reason."""
    if isinstance(value, str):
        urls = [u for u in re.split(r"[\s,]+", value) if u]
    elif isinstance(value, (list, tuple)) and all(isinstance(u, str) for u in value):
        urls = [u.strip() for u in value if u.strip()]
    else:
        raise TypeError(f"{where} must be an apprise URL, a list of them, or None; got "
                        f"{type(value).__name__}")
    if not urls:
        return []
    import apprise

    for url in urls:
        with apprise.LogCapture(level=apprise.logging.WARNING, fmt="%(message)s") as log:
            usable = apprise.Apprise.instantiate(url) is not None
        if not usable:
            why = "; ".join(line for line in log.getvalue().splitlines() if line)
            raise ValueError(f"{where}: {masked(url)!r} is not a notification URL apprise can use"
                             f" ({why or 'not understood'}). Give apprise URLs such as {EXAMPLES};"
                             " `apprise --details` lists every service and its URL form")
    return urls


def masked(url: str) -> str:
    """The URL with the password of its user part hidden (what logs and errors show)."""
    return re.sub(r"(://[^/:@]*):[^/@]*@", r"\1:***@", url)


def save(run_dir: str | os.PathLike, urls: list[str]) -> None:
    """Keep a launched run's URLs for its recorder's sender (nothing when there are none)."""
    if not urls:
        return
    path = RunFolder(run_dir).notify_file
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # not the share group's file mode: the URLs hold credentials
    with open(fd, "w") as f:
        json.dump({"urls": urls}, f)


# --- the end -------------------------------------------------------------------------------------
def after_end(registry: Any, run_id: str) -> None:
    """Called by a launched run's recorder once the final status is written: start the sender if
    the run has URLs. Never raises, never waits for the sender."""
    try:
        row = registry.get_run(run_id)
        if not row or not row.get("run_dir") or not RunFolder(row["run_dir"]).notify_file.exists():
            return
        log = RunFolder(row["run_dir"]).log_file(None)
        with open(log, "ab") as out:  # the sender appends its outcome line here
            subprocess.Popen([sys.executable, "-m", __name__, str(registry.path), run_id],
                             stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                             start_new_session=True, close_fds=True)
    except Exception as exc:  # noqa: BLE001 - a notice must never break the record of the end
        print(f"gpu_lab notify: run {run_id}: no notice sent: its sender did not start "
              f"({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)


def send_end(row: dict, urls: list[str], out: TextIO | None = None,
             timeout: float = SEND_TIMEOUT_S) -> int:
    """Send the end notice of the run in `row` to `urls`; returns how many took it. One line in
    `out` (stderr by default) gives the count and each failure. Never raises."""
    out = out or sys.stderr
    try:
        title, body, kind = compose(row)
        sent, failures = deliver(urls, title, body, kind, timeout)
    except Exception as exc:  # noqa: BLE001 - counted below, like a refused URL
        sent, failures = 0, [f"{type(exc).__name__}: {exc}"]
    print(f"gpu_lab notify: run {row.get('id')} {row.get('status')}: notice sent to {sent} of "
          f"{len(urls)} URL(s)" + (f"; not sent: {'; '.join(failures)}" if failures else ""),
          file=out, flush=True)
    return sent


def compose(row: dict) -> tuple[str, str, str]:
    """(title, body, apprise type) of a run's end notice."""
    from .registry import _duration

    name, status = row.get("name") or row["id"], row["status"]
    took = _duration((row.get("ended") or time.time()) - row["started"]) \
        if row.get("started") else "an unknown time"
    lines = [f"Run {name} ({row['id']}) {status} after {took} on "
             f"{row.get('host') or socket.gethostname()}."]
    detail = headline(row) if status == "failed" else row.get("reason")
    if detail:
        lines.append(detail)
    if row.get("note"):  # what the record says of itself: a full disk paused it, say
        lines.append(row["note"])
    if row.get("last_step") is not None:
        lines.append(f"Last step: {row['last_step']}.")
    return f"gpu_lab: {name} {status}", "\n".join(lines), KINDS.get(status, "info")


def headline(row: dict) -> str:
    """The failure's first triage line, as the run view's triage box starts."""
    from ..failures.triage import RunError, failures_of

    failures = failures_of(RunFolder(row["run_dir"]).read_errors()) if row.get("run_dir") else []
    report = RunError(failures, supervisor=None if failures else row.get("error"))
    return report.headline or "the run failed (no triage was recorded)"


def deliver(urls: list[str], title: str, body: str, kind: str,
            timeout: float = SEND_TIMEOUT_S) -> tuple[int, list[str]]:
    """Send to each URL in turn, all within `timeout` s: (how many took it, why each other did
    not, with its password masked)."""
    import apprise

    outcome: list[str | None] = []  # per URL in order: None = sent, else the reason

    def send_all() -> None:
        for url in urls:
            try:
                with apprise.LogCapture(level=apprise.logging.WARNING, fmt="%(message)s") as log:
                    box = apprise.Apprise()
                    box.add(url)
                    ok = bool(box.notify(body=body, title=title, notify_type=kind))
                reasons = [line for line in log.getvalue().splitlines() if line]
                outcome.append(None if ok else (reasons[-1] if reasons else "refused"))
            except Exception as exc:  # noqa: BLE001 - one URL's bug must not cost the others
                outcome.append(f"{type(exc).__name__}: {exc}")

    worker = threading.Thread(target=send_all, name="gpu_lab-notify", daemon=True)
    worker.start()
    worker.join(timeout)
    done = list(outcome)
    failures = [f"{masked(u)}: {why}" for u, why in zip(urls, done) if why is not None]
    failures += [f"{masked(u)}: no answer within {timeout:.0f} s" for u in urls[len(done):]]
    return sum(why is None for why in done), failures


def main(argv: Sequence[str]) -> int:
    """The sender of a launched run (started by `after_end`): REGISTRY_PATH RUN_ID."""
    from .registry import Registry

    registry_path, run_id = argv
    row = Registry(registry_path).get_run(run_id)
    if row is None or not row.get("run_dir"):
        print(f"gpu_lab notify: run {run_id}: not in {registry_path}; no notice sent",
              file=sys.stderr, flush=True)
        return 1
    path = RunFolder(row["run_dir"]).notify_file
    try:
        urls = json.loads(path.read_text())["urls"]
        path.unlink()
    except (OSError, ValueError, KeyError) as exc:
        print(f"gpu_lab notify: run {run_id}: no notice sent: {path} unreadable ({exc})",
              file=sys.stderr, flush=True)
        return 1
    return 0 if send_end(_ended(row), urls) == len(urls) else 1


def _ended(row: dict) -> dict:
    """The row, with the supervisor's status.json as the end when the registry missed it (its
    write failed): a notice never says 'running'."""
    from .events import FINAL_STATUSES

    if row["status"] in FINAL_STATUSES:
        return row
    last = RunFolder(row["run_dir"]).read_status()
    if last is None:
        from .events import LOST

        last = {"status": "lost", "reason": LOST}
    return {**row, "status": last.get("status") or "lost", "reason": last.get("reason"),
            "ended": last.get("t") or row.get("ended")}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
