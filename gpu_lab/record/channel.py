"""A run's event channel is private: ZeroMQ CURVE, with keys made for that run.

Contract: the recorder's sockets (the ranks' PULL, the readers' PUB) are CURVE servers, and its
ZAP handler admits one client key, the run's. A process without that key's secret can neither
push events into the run (its connection is refused before any message is read) nor subscribe
to what the run publishes (nothing arrives); traffic is encrypted, so the same holds over TCP
between hosts. A reader also checks the recorder: only the holder of the run's server secret can
publish to it, so a stale address taken over by someone else delivers nothing.

How the keys travel:
- a launch makes them in the kernel before the fork; the client key goes to
  `<run folder>/channel.key` (mode 0600, 0660 with GPU_LAB_SHARE_GROUP; see gpu_lab.access),
  where the owner's readers (`attach`, the server extension) find it, and to the ranks in the
  environment variable GPU_LAB_EVENTS_KEY (a process's environment is readable by its user only);
  the recorder process gets the server pair on its stdin, and it is never written to disk;
- a headless rank (gpu_lab.rank.headless) records through a Recorder in its own process: that Recorder makes
  a key of its own, which never leaves the rank's process and its children;
- the other nodes of a multi-node run (gpu_lab.supervise.multinode) make client pairs of their
  own and send node 0 only the public halves, over the rendezvous store; node 0's recorder admits
  them (`Gate.admit`) and they get its public key and address back: no secret leaves a host.
"""
from __future__ import annotations

import hmac
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ENV_KEY = "GPU_LAB_EVENTS_KEY"   # the run's client key, for the ranks (ClientKey.encode())
ZAP_DOMAIN = b"gpu_lab"
_Z85_LEN = 40


def _check(label: str, value: Any) -> str:
    if not isinstance(value, str) or len(value) != _Z85_LEN:
        shown = f"{len(value)} characters" if isinstance(value, str) else type(value).__name__
        raise ValueError(f"run channel key: {label} must be a {_Z85_LEN}-character Z85 CURVE key "
                         f"(zmq.curve_keypair()); got {shown}. Relaunch the run, or unset "
                         f"{ENV_KEY} if it was set by hand")
    return value


@dataclass(frozen=True)
class ClientKey:
    """What a rank or a reader holds: the recorder's public key and the run's client pair."""

    server: str
    public: str
    secret: str

    def __post_init__(self) -> None:
        for label in ("server", "public", "secret"):
            _check(label, getattr(self, label))

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def decode(cls, text: str | bytes) -> "ClientKey":
        try:
            d = json.loads(text)
            return cls(d["server"], d["public"], d["secret"])
        except (ValueError, TypeError, KeyError):
            raise ValueError(f"run channel key: expected JSON with 'server', 'public' and "
                             f"'secret' (ClientKey.encode()); got {str(text)[:20]!r}...") from None

    def apply(self, sock: Any) -> None:
        """Make `sock` a CURVE client of the run's recorder: call before each connect(), which
        takes the options set at that moment (one SUB socket holds many runs' connections)."""
        sock.curve_serverkey = self.server.encode()
        sock.curve_publickey = self.public.encode()
        sock.curve_secretkey = self.secret.encode()


@dataclass(frozen=True)
class RunKeys:
    """A run's keys: the recorder's (server) pair and the client key."""

    public: str
    secret: str
    client: ClientKey

    @classmethod
    def new(cls) -> "RunKeys":
        import zmq

        server_public, server_secret = zmq.curve_keypair()
        public, secret = zmq.curve_keypair()
        return cls(server_public.decode(), server_secret.decode(),
                   ClientKey(server_public.decode(), public.decode(), secret.decode()))

    def encode(self) -> str:
        return json.dumps({"public": self.public, "secret": self.secret,
                           "client": asdict(self.client)}, separators=(",", ":"))

    @classmethod
    def decode(cls, text: str | bytes) -> "RunKeys":
        try:
            d = json.loads(text)
            return cls(_check("public", d["public"]), _check("secret", d["secret"]),
                       ClientKey(**d["client"]))
        except (TypeError, KeyError):
            raise ValueError("run channel keys: expected JSON with 'public', 'secret' and "
                             "'client' (RunKeys.encode())") from None


def save_client_key(run_dir: str | os.PathLike, key: ClientKey) -> Path:
    """Write the run's client key where the owner's readers look for it (owner-only mode)."""
    from .runfolder import RunFolder

    return RunFolder(run_dir).write_key(key.encode())


def load_client_key(run_dir: str | os.PathLike | None) -> ClientKey | None:
    """The run's client key from its folder; None where there is none or it cannot be read
    (another user's run): such a reader follows the registry only, if it can read that."""
    from .runfolder import RunFolder

    text = RunFolder(run_dir).read_key() if run_dir else None
    try:
        return ClientKey.decode(text) if text is not None else None
    except ValueError:
        return None


class Gate:
    """The recorder's side: a ZAP handler that admits the run's client key only, and the CURVE
    server options for every socket the recorder binds (set them before bind())."""

    def __init__(self, ctx: Any, keys: RunKeys) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        self.keys = keys
        self.admitted = 0
        self.refused = 0   # handshakes with another key: counted, never read
        self._clients = frozenset([keys.client.public.encode()])  # replaced whole by admit()
        self._auth = ThreadAuthenticator(ctx, log=_quiet_log())
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN.decode(), self)

    def callback(self, domain: str, key: bytes) -> bool:  # ZAP, on the authenticator's thread
        ok = any(hmac.compare_digest(key, c) for c in self._clients)
        if ok:
            self.admitted += 1
        else:
            self.refused += 1
        return ok

    def admit(self, public: str) -> None:
        """Also admit another client key: another node's, whose secret stays on that node."""
        self._clients = self._clients | {_check("admitted public", public).encode()}

    def secure(self, sock: Any) -> None:
        sock.zap_domain = ZAP_DOMAIN
        sock.curve_secretkey = self.keys.secret.encode()
        sock.curve_publickey = self.keys.public.encode()
        sock.curve_server = True

    def close(self) -> None:
        self._auth.stop()


def _quiet_log() -> Any:
    """The authenticator logs every refusal; the Gate counts them instead."""
    import logging

    log = logging.getLogger("gpu_lab.record.channel.zap")
    log.setLevel(logging.ERROR)
    return log
