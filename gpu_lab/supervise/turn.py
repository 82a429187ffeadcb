"""A run's turn on the host, in its supervisor: try its devices at once (the kernel's launch()
hears the outcome), then, if they are taken, wait in the host's queue (gpu_lab.supervise.claims)
while the run's recorder tells the registry its place."""
from __future__ import annotations

import os
from typing import Any

from .claims import DevicesBusy, wait_for_devices

# What the supervisor tells its launching kernel over the "joined" pipe, first byte of each word
# (gpu_lab.launch.launcher reads them): the devices are busy and it may not wait (then why), it
# could not claim them (then why), it started at once, it has its place in the queue.
BUSY, ERROR, STARTED, QUEUED = b"b", b"e", b"s", b"q"


def try_devices(spec: Any) -> tuple[Any, BaseException | None]:
    """(the run's devices if they are free now, else None; why it may not wait for them): it will
    wait its turn, or, with queue=False, fail naming who holds them. The kernel's launch() hears
    which; of a run that waits, once it has its place (wait_turn)."""
    joined = _Joined(spec.joined_fd)
    try:
        claim = wait_for_devices(_request(spec), spec.run_id, spec.priority, queue=False,
                                 key=_key(spec), kind=_kind(spec), submitted=spec.submitted)
    except DevicesBusy as exc:
        if spec.queue:  # the kernel hears once the run has its ticket (wait_turn)
            return None, None
        joined.say(BUSY + str(exc).encode()[:3000])
        return None, exc
    except Exception as exc:  # noqa: BLE001 - a claims folder it may not use, say
        joined.say(ERROR + f"{type(exc).__name__}: {exc}".encode()[:3000])
        return None, exc
    joined.say(STARTED)
    return claim, None


def wait_turn(spec: Any, recorder: Any, claim: Any) -> Any:
    """Wait in the host's queue for the run's devices (gpu_lab.supervise.claims), unless it has
    them; the recorder hears the run's place and its start. A stop while it waits (Run.stop,
    run.cancel) raises here; a detach=False run whose kernel exits is withdrawn."""
    from ..record import recorder as rec  # zmq: in the supervisor only

    parent = os.getppid()
    if claim is None:
        joined = _Joined(spec.joined_fd)

        def placed(n: int) -> None:
            rec.queued(recorder, n)
            joined.say(QUEUED)  # once: gpu_lab.queue() in the kernel now lists the run

        claim = wait_for_devices(_request(spec), spec.run_id, spec.priority, key=_key(spec),
                                 kind=_kind(spec), submitted=spec.submitted, on_position=placed,
                                 cancelled=lambda: not spec.detach and os.getppid() != parent)
        joined.say(QUEUED)  # the devices were free by then: no wait, and a start
    rec.started(recorder, claim.as_record())
    return claim


def _request(spec: Any) -> Any:
    return spec.gpus if spec.gpus is not None else spec.num_processes


def _key(spec: Any) -> str | None:  # the nodes of one multi-node run on a host share a claim
    return f"{spec.master_addr}:{spec.port}" if spec.num_nodes > 1 else None


def _kind(spec: Any) -> str:
    return "gpu" if spec.device == "cuda" else "cpu"


class _Joined:
    """The kernel's launch() waits for one word: the run has its place in the host's queue (so
    runs launched one after another queue in that order), or why it has none."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd

    def say(self, word: bytes) -> None:
        if self.fd is None:
            return
        try:
            os.write(self.fd, word)
        except OSError:  # the kernel stopped listening: nothing to tell
            pass
        os.close(self.fd)
        self.fd = None
