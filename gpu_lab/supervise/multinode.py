"""Multi-node launches: one gpu_lab.launch() call per node, all meeting at one rendezvous.

accelerate's notebook_launcher covers one node well, but two of its multi-node paths do not
rendezvous: with one process per node (`num_processes=1`) it calls the function in place, so two
"nodes" train alone with world size 1; and with `rdzv_backend="c10d"` it leaves the rendezvous
endpoint empty, so torch falls back to localhost:29400 on every node. For `num_nodes > 1` the
supervisor calls torch's elastic launcher directly, as notebook_launcher does for one node (same
environment, fork start, the function itself as the entry point), with the endpoint set to
`master_addr:port` for both backends.

One run, one record: node 0's recorder receives every node's ranks. On node 0 it binds on
master_addr's interface (not loopback), and node 0's supervisor hosts the rendezvous store at
master_addr:port before the rendezvous does (both backends open it multi-tenant, so they share
that server). Through the store, under `gpu_lab/record/`:
- node 0 says `recorder` = {run, host, address, server}: its run id, the recorder's address and
  its public key;
- each other node k makes a client pair of its own and says `node/k` = {public, run, host};
  node 0's recorder admits that public key, and node 0 then says `admitted/k`;
- node k waits for `admitted/k` before its ranks start, so its first event is admitted.
Only public keys travel (the store is plaintext); each secret stays on its node. Node k's
launch keeps a row of its own (its status, its logs, its rank files), whose `part_of` names
node 0's run; its ranks' metrics, logs and checkpoints belong to node 0's run.

One end (NodeEnds): a stop reaches one node (its kernel's Run.stop(), its side panel's Stop), and
a rank that is not in fit() dies of it, so the other nodes' ranks see their peers vanish and would
end `failed`. Each node says `end/<node rank>` = {status, reason} once it has decided its end,
and a thread on each watches the others' while its ranks run: another node stopped, it stops its
own ranks the way Run.stop() does. A node that failed or stopped without a stop of its own waits
for the others' ends (at most HEAD_WAIT s) and takes a stop among them as its end. So a stop on
any node ends every node `stopped`, with that stop's reason. Node 0 hosts the store, so it holds
it until every other node says `done/k` (at most DONE_WAIT s).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from dataclasses import fields
from datetime import timedelta
from typing import Any, Callable

PREFIX = "gpu_lab/record/"
JOIN_TIMEOUT = 900.0  # s a node waits for the others' word: torch's default rendezvous timeout
DONE_WAIT = 15.0  # s node 0 holds the store for the other nodes to hear its end
HEAD_WAIT = 30.0  # s a node waits for the others' ends before deciding its failure alone
STOP_ENDS = ("stopped", "pruned")  # ends that the other nodes take as theirs


def record_host(master_addr: str) -> str:
    """The address node 0's recorder binds on: master_addr's, which the other nodes reach."""
    try:
        return socket.gethostbyname(master_addr)
    except OSError as exc:
        raise ValueError(f"launch: master_addr {master_addr!r} does not resolve ({exc}); pass "
                         "node 0's address as the other nodes reach it") from None


def _store(master_addr: str, port: int, host: bool, timeout: float = JOIN_TIMEOUT) -> Any:
    """The rendezvous store at master_addr:port: hosted here (node 0), or reached (the others,
    which may start first: they knock, a second at a time, so that a stop is heard meanwhile,
    and torch's client, whose failed tries each log a stack trace, connects once it answers)."""
    from torch.distributed import TCPStore

    deadline = time.monotonic() + timeout
    while not host:
        try:
            socket.create_connection((master_addr, port), timeout=1.0).close()
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(f"multi-node run: nothing answers at {master_addr}:{port} "
                                   f"({exc}) after {timeout:.0f} s; start node 0's launch, "
                                   "check that master_addr is node 0's address as this node "
                                   "reaches it and that the port is open between them") from None
            time.sleep(0.2)
    # multi_tenant: the rendezvous opens the same server in this process (both backends do)
    return TCPStore(master_addr, port, is_master=host, multi_tenant=True, wait_for_workers=False,
                    timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())))


def _wait(store: Any, key: str, what: str, timeout: float) -> dict:
    """The value of `key` once it is set; a short wait at a time, so that a stop is heard."""
    deadline = time.monotonic() + timeout
    while not store.check([PREFIX + key]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"multi-node run: {what} within {timeout:.0f} s; start every "
                               "node's launch with the same master_addr, port and num_nodes")
        time.sleep(0.05)
    return json.loads(store.get(PREFIX + key))


def host_record(master_addr: str, port: int, num_nodes: int, run_id: str, address: str,
                server_public: str, admit: Callable[[str, dict], None],
                timeout: float = JOIN_TIMEOUT) -> Any:
    """Node 0: say where the run's recorder is, admit each other node's key. Returns the store,
    to be held until the rendezvous has opened it too (the ranks' launch)."""
    store = _store(master_addr, port, host=True, timeout=timeout)
    store.set(PREFIX + "recorder", json.dumps({"run": run_id, "host": socket.gethostname(),
                                               "address": address, "server": server_public}))
    for k in range(1, num_nodes):
        part = _wait(store, f"node/{k}", f"node {k} did not join", timeout)
        admit(str(part.get("public")), {**part, "node_rank": k})
        store.set(f"{PREFIX}admitted/{k}", "1")
    return store


def join_record(master_addr: str, port: int, node_rank: int, run_id: str,
                timeout: float = JOIN_TIMEOUT) -> dict:
    """Node k > 0: where this node's ranks report ({run, host, address, key}), once node 0's
    recorder has admitted the client key made here."""
    import zmq

    from ..record.channel import ClientKey

    public, secret = (k.decode() for k in zmq.curve_keypair())
    store = _store(master_addr, port, host=False, timeout=timeout)
    store.set(f"{PREFIX}node/{node_rank}", json.dumps({"public": public, "run": run_id,
                                                       "host": socket.gethostname()}))
    _wait(store, f"admitted/{node_rank}", f"node 0 ({master_addr}:{port}) did not admit node "
          f"{node_rank}", timeout)
    head = _wait(store, "recorder", "node 0 did not say where its recorder is", timeout)
    return {"run": head["run"], "host": head["host"], "address": head["address"],
            "key": ClientKey(head["server"], public, secret), "store": store}


class NodeEnds:
    """One end for every node of a run (module docstring): `watch(folder)` while this node's
    ranks run, `settle(status, reason, asked)` once it has decided its end, and on node 0
    `hold()` once that end is recorded."""

    def __init__(self, store: Any, num_nodes: int, node_rank: int) -> None:
        self.store, self.num_nodes, self.node_rank = store, num_nodes, node_rank
        self.others = [r for r in range(num_nodes) if r != node_rank]
        self._settling = threading.Event()
        self._watcher: threading.Thread | None = None

    def watch(self, folder: Any) -> None:
        """A thread that stops this node's ranks when another node ends stopped."""
        self._watcher = threading.Thread(target=self._watch, args=(folder,), daemon=True,
                                         name="gpu_lab-node-ends")
        self._watcher.start()

    def _ends(self) -> dict[int, dict]:
        """The other nodes' ends, those said so far."""
        keys = {r: f"{PREFIX}end/{r}" for r in self.others}
        return {r: json.loads(self.store.get(k)) for r, k in keys.items()
                if self.store.check([k])}

    def _watch(self, folder: Any) -> None:
        try:
            while not self._settling.wait(0.1):
                stop = _first_stop(self._ends())
                if stop is not None:
                    break
            else:
                return
        except Exception:  # noqa: BLE001 - the store is gone: nothing more will be said
            return
        node, said = stop
        folder.request_stop(said.get("reason") or f"stopped on node {node}", said["status"])
        print(f"gpu_lab supervisor: node {node} ended {said['status']} ({said.get('reason')}); "
              "stopping this node's ranks", flush=True)
        os.killpg(0, signal.SIGTERM)  # as Run.stop(): the ranks checkpoint, the agent returns

    def settle(self, status: str, reason: str | None, asked: bool) -> tuple[str, str | None]:
        """This node's end, said to the others and squared with theirs: (status, reason). A
        node that failed or stopped without a stop of its own (`asked`) takes another node's
        stop as its end: its ranks only lost their peers, or agreed to the others' stop."""
        self._settling.set()
        if self._watcher is not None:
            self._watcher.join(1.0)  # the store's client is this thread's from here
        try:
            self.store.set(f"{PREFIX}end/{self.node_rank}",
                           json.dumps({"status": status, "reason": reason}))
            if status in ("failed", "stopped") and not asked:
                deadline = time.monotonic() + HEAD_WAIT
                while len(ends := self._ends()) < len(self.others) and \
                        time.monotonic() < deadline:
                    time.sleep(0.05)
                stop = _first_stop(ends)
                if stop is not None:
                    node, said = stop
                    status, reason = said["status"], said.get("reason") or f"stopped on node {node}"
            if self.node_rank > 0:
                self.store.set(f"{PREFIX}done/{self.node_rank}", "1")
        except Exception:  # noqa: BLE001 - the other side is gone: this node's own word stands
            pass
        return status, reason

    def hold(self) -> None:
        """Node 0, its end recorded: keep the store (which it hosts) until every other node has
        settled (at most DONE_WAIT s; a stop's grace may end this process sooner, its end kept)."""
        try:
            if self.node_rank == 0:
                done = [f"{PREFIX}done/{k}" for k in self.others]
                deadline = time.monotonic() + DONE_WAIT
                while not self.store.check(done) and time.monotonic() < deadline:
                    time.sleep(0.05)
        except Exception:  # noqa: BLE001 - a node gone: nothing more to wait for
            pass
        self.store = None  # node 0's server closes once the others heard its end


def _first_stop(ends: dict[int, dict]) -> tuple[int, dict] | None:
    """The first node (by rank) whose end is a stop, and what it said."""
    return next(((r, e) for r, e in sorted(ends.items()) if e.get("status") in STOP_ENDS), None)


def rendezvous_config(backend: str, node_rank: int) -> dict[str, Any]:
    """static: each node states its rank. c10d: node 0 hosts the store (the master's address is
    node 0's), the others connect; ranks come from the order in which nodes join."""
    if backend == "static":
        return {"rank": node_rank}
    if backend == "c10d":
        return {"is_host": node_rank == 0}
    raise ValueError(f"rdzv_backend: got {backend!r}; accepted: 'static', 'c10d'")


def launch_nodes(entry: Callable, args: tuple, *, num_processes: int, num_nodes: int,
                 node_rank: int, master_addr: str, port: int, rdzv_backend: str,
                 mixed_precision: str) -> None:
    """Start this node's `num_processes` ranks of a `num_nodes`-node job and block until they end.

    Raises torch's ChildFailedError when a rank fails, like notebook_launcher.
    """
    from accelerate.utils import patch_environment
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    env = dict(nproc=num_processes, node_rank=node_rank, world_size=num_nodes * num_processes,
               master_addr=master_addr, master_port=str(port),
               accelerate_mixed_precision=mixed_precision)
    with patch_environment(**env):
        kw: dict[str, Any] = {}
        has_numa = any(f.name == "numa_options" for f in fields(LaunchConfig))
        if has_numa:
            # Without numa_options, LaunchConfig asks torch.accelerator.is_available(), which
            # initialises CUDA here in the supervisor: every forked rank would then be in CUDA's
            # bad-fork state. Pass a value, then clear it (what notebook_launcher does).
            from torch.numa.binding import AffinityMode, NumaOptions

            kw["numa_options"] = NumaOptions(AffinityMode.NODE)
        config = LaunchConfig(
            min_nodes=num_nodes, max_nodes=num_nodes, nproc_per_node=num_processes,
            run_id=f"gpu_lab-{port}",  # the same on every node: the port names the job
            rdzv_endpoint=f"{master_addr}:{port}", rdzv_backend=rdzv_backend,
            rdzv_configs=rendezvous_config(rdzv_backend, node_rank),
            max_restarts=0, monitor_interval=0.1, start_method="fork",
            # the ranks meet at node 0's address as the others reach it, not at its host name's
            # (which may resolve to loopback, or to an interface the other nodes cannot reach)
            local_addr=record_host(master_addr) if node_rank == 0 else None, **kw)
        if has_numa:
            config.numa_options = None
        elastic_launch(config=config, entrypoint=entry)(*args)


def join_nodes(spec: Any, recorder: Any, where: dict) -> tuple[dict, Any]:
    """For the supervisor (`spec`: its Spec): where the ranks report ({run, address, key}) and the
    store to hold while they run. This run's recorder on one node and on node 0; node 0's on the
    others, whose rows then point at node 0's run."""
    from ..record import recorder as rec

    own = {"run": spec.run_id, "address": where["address"], "key": spec.keys.client}
    if spec.num_nodes == 1:
        return own, None
    if spec.node_rank == 0:
        def admit(public: str, part: dict) -> None:
            rec.admit(recorder, public, note=part)

        return own, host_record(spec.master_addr, spec.port, spec.num_nodes, spec.run_id,
                                where["address"], spec.keys.public, admit)
    target = join_record(spec.master_addr, spec.port, spec.node_rank, spec.run_id)
    rec.part_of(recorder, {"run": target["run"], "host": target["host"],
                           "node_rank": spec.node_rank})
    print(f"gpu_lab supervisor: node {spec.node_rank}'s ranks report to run {target['run']} on "
          f"{target['host']} ({target['address']})", flush=True)
    return target, target.pop("store")
