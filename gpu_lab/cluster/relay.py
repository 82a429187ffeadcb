"""The recorders of a registry's Slurm jobs, on the host of the registry (in its follower).

A job runs on other machines; its registry stays on the machine it was submitted from, because
SQLite's WAL needs its writer and readers on one host. So each active job's recorder is a
Recorder thread in the follower, bound where the job's first node reaches it (the host and port
gpu_lab.submit wrote to the run folder's job/channel.json), with the keys submit made
(job/server.key, owner-only: a restarted follower listens again on the same port with the same
keys, and the ranks' sockets reconnect by themselves). The ranks report to it; the job's
supervisor tells it its status changes as rank -1 status events marked "from": "job", which
apply() turns into the row's status; the job's end waits (settle) until the record holds what
the ranks say they sent, then is written and published as "from": "record". Everything the job
sends is checked, recorded and published as a launched run's is; the run's readers follow it
live through the recorder's PUB.
"""
from __future__ import annotations

import json
import queue
import socket
import time
from typing import Any

from ..record import events as ev
from ..record.channel import RunKeys
from ..record.runfolder import RunFolder

FROM_JOB = ev.FROM_JOB  # the `from` of the status events the job's supervisor sends
QUIET_LOOKS = 1   # looks after a run's end before its recorder closes (stragglers still land)
END_WAIT_S = 10.0  # seconds a job's end waits for reports its ranks sent and the record lacks
FROM_RECORD = "record"  # the `from` of the end this relay writes after the job's own word


class Relay:
    def __init__(self, registry: Any) -> None:
        self.registry = registry
        self.recorders: dict[str, Any] = {}
        self.applied: dict[str, int] = {}   # run id -> seq of the last status event applied
        self.ended: dict[str, int] = {}     # run id -> looks since its end
        self.news: queue.SimpleQueue = queue.SimpleQueue()  # runs whose job said something
        # run id -> (the job's final status event, monotonic time it was applied): ends that wait
        # for the ranks' last reports, which travel on other sockets and can land after it
        self.ending: dict[str, tuple[dict, float]] = {}

    def serve(self, row: dict) -> None:
        """The run's recorder, listening (again) where the job reports."""
        rid = row["id"]
        if rid in self.recorders or not row.get("run_dir"):
            return
        from ..record.recorder import Recorder

        folder = RunFolder(row["run_dir"])
        try:
            keys = RunKeys.decode(folder.job_file("keys").read_text())
            where = json.loads(folder.job_file("channel").read_text())
        except (OSError, ValueError):
            return  # not a run that gpu_lab.submit made with a channel
        try:
            rec = Recorder(self.registry, rid, keys=keys, host=where["host"], port=where["port"],
                           on_written=lambda batch, rid=rid: self._heard(rid, batch))
        except Exception as exc:  # noqa: BLE001 - the port is taken: the next attempt reads anew
            print(f"{time.strftime('%H:%M:%S')} run {rid}: cannot listen on {where['host']}:"
                  f"{where['port']} ({exc}); a free port instead", flush=True)
            rec = Recorder(self.registry, rid, keys=keys, host=where["host"],
                           on_written=lambda batch, rid=rid: self._heard(rid, batch))
            port = int(rec.address.rsplit(":", 1)[1])
            folder.write_job_file("channel", json.dumps({"host": where["host"], "port": port}))
        self.recorders[rid] = rec
        self.registry.update(rid, events_address=rec.publish_address)

    def _heard(self, run_id: str, batch: list) -> None:
        """On a recorder's thread: the job said something about its status."""
        if run_id in self.ending or any(
                isinstance(e, dict) and e.get("kind") == ev.STATUS and e.get("rank") == -1
                for e in batch):
            self.news.put(run_id)

    def apply(self, row: dict) -> dict:
        """Turn the job's status events since the last applied into the row; the row as it is
        now. Only an active run changes (a final status is never revived)."""
        rid = row["id"]
        if rid in self.ending:
            self.settle(rid)
        for e in self.registry.events(rid, after=self.applied.get(rid, 0), kinds=[ev.STATUS]):
            self.applied[rid] = e["seq"]
            data = e["data"] if isinstance(e["data"], dict) else {}
            if e["rank"] != -1 or data.get("from") != FROM_JOB or data.get("status") not in \
                    ev.STATUSES:
                continue
            status = data["status"]
            if status in ev.FINAL_STATUSES:
                self.ending[rid] = (data, time.monotonic())
                self.settle(rid)
                continue
            if self.registry.set_status(rid, status, reason=data.get("reason"), final=False) \
                    and status == "running":
                job = dict(self.registry.get_run(rid).get("job") or {})
                job.update({k: data[k] for k in ("attempt", "nodes", "batch_host") if k in data},
                           state="RUNNING", reason=None)
                self.registry.update(rid, ended=None, reason=None, job=job)
        return self.registry.get_run(rid) or row

    def settle(self, rid: str) -> bool:
        """Write the end a job said once the record holds every report its ranks say they sent
        (or END_WAIT_S after it: the shortfall is counted when the recorder closes), and
        publish it, so that a Run's wait() returns with the whole record. Whether it did."""
        data, since = self.ending[rid]
        if not self._reports_in(rid) and time.monotonic() - since < END_WAIT_S:
            return False
        del self.ending[rid]
        status = data["status"]
        if self.registry.set_status(rid, status, reason=data.get("reason"),
                                    error=data.get("error")):
            end = {k: data[k] for k in ("status", "reason", "exitcode", "error") if k in data}
            e = ev.make(rid, -1, ev.STATUS, dict(end, **{"from": FROM_RECORD}))
            if not self.record(rid, [e]):
                self.registry.add_events(rid, [e])
        return True

    def _reports_in(self, rid: str) -> bool:
        row = self.registry.get_run(rid)
        if not row or not row.get("run_dir"):
            return True
        sent = RunFolder(row["run_dir"]).sent()  # a rank killed before it said: nothing to wait for
        if not sent:
            return True
        rec = self.recorders.get(rid)
        if rec is not None:
            rec.flush()
        have = self.registry.events_by_rank(rid)
        return all(have.get(r, 0) >= n for r, n in sent.items())

    def record(self, run_id: str, events: list[dict]) -> bool:
        """Record (and publish) events through the run's recorder, if it has one."""
        rec = self.recorders.get(run_id)
        if rec is None:
            return False
        rec.record(events)
        return True

    def retire(self, active: set[str]) -> None:
        """Close the recorders of runs that ended QUIET_LOOKS looks ago."""
        for rid in [r for r in self.recorders if r not in active]:
            if self.ended.get(rid, 0) >= QUIET_LOOKS:
                rec = self.recorders.pop(rid)
                self._count_undelivered(rid, rec)
                rec.close(quiet=1.0)
                self.ended.pop(rid, None)
            else:
                self.ended[rid] = self.ended.get(rid, 0) + 1

    def _count_undelivered(self, rid: str, rec: Any) -> None:
        """Events the ranks sent that are not in the record (a follower killed while they were on
        the way, its recorder with it): counted in a `dropped` note, never lost silently."""
        row = self.registry.get_run(rid)
        if not row or not row.get("run_dir"):
            return
        from ..record.recorder import count_undelivered

        count_undelivered(self.registry, rid, rec, RunFolder(row["run_dir"]).sent(),
                          "the recorder's process (this host's follower) ended while they "
                          "were on the way")

    def close(self) -> None:
        for rec in self.recorders.values():
            rec.close()
        self.recorders.clear()


def recorder_host() -> str:
    """The address a job's first node reaches this host on: GPU_LAB_RECORDER_HOST, else the
    address this host's name resolves to, else loopback (a cluster on this machine)."""
    import os

    given = os.environ.get("GPU_LAB_RECORDER_HOST")
    if given:
        return socket.gethostbyname(given)
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
