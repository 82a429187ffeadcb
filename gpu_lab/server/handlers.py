"""Tornado handlers: thin, authenticated, and never blocking the IOLoop.

Every method carries `@web.authenticated` (or `@ws_authenticated` for the websocket), so a request
without a token or login cookie gets 403, and the server's check for undecorated endpoints
(`allow_unauthenticated_access=False`) has nothing to warn about. `@authorized` lets a custom
Authorizer restrict the "gpu_lab" resource (read: GET, write: POST).
"""
from __future__ import annotations

import asyncio
import functools
import json
import re
import sqlite3
from typing import Any, Callable

from jupyter_core.utils import ensure_async
from jupyter_server.auth.decorator import authorized, ws_authenticated
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from jupyter_server.base.websocket import WebSocketMixin
from jupyter_server.utils import url_path_join
from tornado import web, websocket

from . import runview
from .hub import DEFAULT_INTERVAL, MAX_HISTORY, clamp_interval
from .state import ServerState

AUTH_RESOURCE = "gpu_lab"
_RUN_ID_CHARS = r"[A-Za-z0-9._-]{1,128}"
_RUN_ID = rf"(?P<run_id>{_RUN_ID_CHARS})"
_RUN_ID_RE = re.compile(_RUN_ID_CHARS)


class _Base(APIHandler):
    auth_resource = AUTH_RESOURCE

    @property
    def state(self) -> ServerState:
        return self.settings["gpu_lab"]

    async def off_loop(self, fn: Callable, *args: Any) -> Any:
        """Run blocking work (SQLite, NVML, signalling) in the extension's thread pool. A registry
        that cannot serve the request (damaged, read-only) answers with what to do, in JSON."""
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self.state.executor, functools.partial(fn, *args))
        except sqlite3.DatabaseError as e:
            raise registry_http_error(e, self.state) from e

    def int_arg(self, name: str, default: int, lo: int, hi: int) -> int:
        raw = self.get_argument(name, None)
        if raw is None:
            return default
        try:
            v = int(raw)
        except ValueError:
            raise web.HTTPError(400, f"query parameter {name}: got {raw!r}; expected an integer "
                                     f"in [{lo}, {hi}]")
        if not lo <= v <= hi:
            raise web.HTTPError(400, f"query parameter {name}: got {v}; accepted range [{lo}, {hi}]")
        return v


class InfoHandler(_Base):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.finish(json.dumps(await self.off_loop(self.state.info)))


class TelemetryHandler(_Base):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        n = self.int_arg("n", 60, 0, MAX_HISTORY)
        self.finish(json.dumps(await self.off_loop(self.state.telemetry, n)))


class RunsHandler(_Base):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        limit = self.int_arg("limit", 100, 1, 1000)
        offset = self.int_arg("offset", 0, 0, 10**9)
        self.finish(json.dumps(await self.off_loop(self.state.runs_and_sweeps, limit, offset,
                                                   self._query())))

    def _query(self) -> Any:
        """?q=words&status=failed&since=<epoch s>&until=<epoch s>&config=lr:0.1,model:resnet50:
        a search of the runs (RunQuery), or None without any of them."""
        from gpu_lab.record.events import STATUSES
        from gpu_lab.record.registry import RunQuery

        text = self.get_argument("q", "")[:200]
        status = self.get_argument("status", None) or None
        if status is not None and status not in STATUSES:
            raise web.HTTPError(400, f"query parameter status: got {status!r}; accepted: "
                                     f"{', '.join(STATUSES)}")
        since, until = (self._float_arg(k) for k in ("since", "until"))
        config = []
        for pair in filter(None, self.get_argument("config", "").split(",")):
            key, sep, raw = pair.partition(":")
            if not sep or not re.fullmatch(r"[A-Za-z_]\w*", key.strip()):
                raise web.HTTPError(400, f"query parameter config: got {pair!r}; expected "
                                         "field:value pairs separated by commas (lr:0.1)")
            try:
                value = json.loads(raw)
            except ValueError:
                value = raw  # a word: a string value (model:resnet50)
            config.append((key.strip(), value))
        if not (text.strip() or status or since is not None or until is not None or config):
            return None
        return RunQuery(text=text, status=status, since=since, until=until, config=tuple(config))

    def _float_arg(self, name: str) -> float | None:
        raw = self.get_argument(name, None)
        if raw in (None, ""):
            return None
        try:
            return float(raw)
        except ValueError:
            raise web.HTTPError(400, f"query parameter {name}: got {raw!r}; expected seconds "
                                     "since 1970 (a number)") from None


class RunHandler(_Base):
    @web.authenticated
    @authorized
    async def get(self, run_id: str) -> None:
        points = self.int_arg("points", runview.DEFAULT_POINTS, 4, runview.MAX_POINTS)
        run = await self.off_loop(self.state.get_run, run_id, points)
        if run is None:
            raise _no_run(run_id)
        self.finish(json.dumps(run))


class RunEventsHandler(_Base):
    """A run's events after sequence number `after` (at most `limit`): what a view that has seen
    up to `after` lacks. `more` says whether another page follows."""

    @web.authenticated
    @authorized
    async def get(self, run_id: str) -> None:
        after = self.int_arg("after", 0, 0, 2**62)
        limit = self.int_arg("limit", runview.EVENTS_LIMIT, 1, 10 * runview.EVENTS_LIMIT)
        out = await self.off_loop(self.state.events, run_id, after, limit)
        if out is None:
            raise _no_run(run_id)
        self.finish(json.dumps(out))


class RunLogHandler(_Base):
    """Whole lines of a run's log file from byte `offset` (-1: its tail)."""

    @web.authenticated
    @authorized
    async def get(self, run_id: str, name: str) -> None:
        offset = self.int_arg("offset", -1, -1, 2**62)
        try:
            out = await self.off_loop(self.state.read_log, run_id, name, offset)
        except ValueError as e:
            raise web.HTTPError(400, str(e))
        if out is None:
            raise _no_run(run_id)
        self.finish(json.dumps(out))


class StopRunHandler(_Base):
    @web.authenticated
    @authorized
    async def post(self, run_id: str) -> None:
        try:
            run = await self.off_loop(self.state.stop_run, run_id)
        except KeyError:
            raise _no_run(run_id)
        self.finish(json.dumps(run))


class _ControlHandler(_Base):
    async def control(self, fn: Callable, run_id: str) -> None:
        try:
            out = await self.off_loop(fn, run_id)
        except KeyError:
            raise _no_run(run_id)
        except ValueError as e:  # the library's own message: what is wrong and what to do
            raise web.HTTPError(409, str(e))
        self.finish(json.dumps(out))


class CheckpointHandler(_ControlHandler):
    """Ask a running run for a checkpoint at its next step boundary (Run.request_checkpoint)."""

    @web.authenticated
    @authorized
    async def post(self, run_id: str) -> None:
        await self.control(self.state.request_checkpoint, run_id)


class ResumeHandler(_ControlHandler):
    """gpu_lab.attach(run_id).resume(): a new run from the newest checkpoint of this one."""

    @web.authenticated
    @authorized
    async def post(self, run_id: str) -> None:
        await self.control(self.state.resume, run_id)


class CompareHandler(_Base):
    """?runs=<id>,<id>[,...]: each run's mean curves, and the config fields in which they differ."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        raw = self.get_argument("runs", "")
        ids = [r for r in raw.split(",") if r]
        bad = [r for r in ids if not _RUN_ID_RE.fullmatch(r)]
        if len(ids) < 2 or len(ids) > runview.MAX_COMPARE or bad:
            raise web.HTTPError(400, f"query parameter runs: got {raw[:200]!r}; expected 2 to "
                                     f"{runview.MAX_COMPARE} run ids separated by commas")
        points = self.int_arg("points", runview.DEFAULT_POINTS, 4, runview.MAX_POINTS)
        try:
            out = await self.off_loop(self.state.compare, ids, points)
        except KeyError as e:
            raise _no_run(e.args[0])
        self.finish(json.dumps(out))


def registry_http_error(e: sqlite3.DatabaseError, state: ServerState) -> web.HTTPError:
    """409 for a write to a read-only registry, 503 for a damaged one; the message says what to
    do. Other database errors stay errors of the server (500)."""
    from gpu_lab.record.registry import RegistryError, RegistryReadOnlyError, explain

    err = e if isinstance(e, RegistryError) else explain(e, state.registry_path())
    if err is None:
        raise e
    return web.HTTPError(409 if isinstance(err, RegistryReadOnlyError) else 503, str(err))


def _no_run(run_id: str) -> web.HTTPError:
    return web.HTTPError(404, f"no run with id {run_id!r} in the registry")


class MetricsHandler(_Base):
    """Prometheus text exposition. An APIHandler so that a scrape without credentials gets 403
    rather than a redirect to the login page; Prometheus authenticates with the Jupyter token,
    `authorization: {type: Bearer, credentials_file: <file holding it>}` in the scrape config
    (or `params: {token: [<token>]}`, which shows the token in Prometheus' target list)."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        from .metrics import CONTENT_TYPE, exposition

        body = await self.off_loop(exposition, self.state)
        self.finish(body, set_content_type=CONTENT_TYPE)


class LiveWebSocket(WebSocketMixin, websocket.WebSocketHandler, JupyterHandler):
    """The lab's live feed: telemetry samples, and the runs this browser follows (feeds.py).

    Messages from the client, at any time:
      {"interval": seconds}       telemetry update interval, clamped to at least 0.25 s (query
                                  parameter ?interval= sets the initial one)
      {"follow": run_id, "after": seq, "logs": {"rank0.log": byte offset, ...}}
      {"unfollow": run_id}
    """

    auth_resource = AUTH_RESOURCE
    interval: float = DEFAULT_INTERVAL

    @property
    def state(self) -> ServerState:
        return self.settings["gpu_lab"]

    @ws_authenticated
    async def get(self, *args: Any, **kwargs: Any) -> None:
        # authorisation before the upgrade, like jupyter_server's own kernel websocket
        user = self.current_user
        allowed = self.authorizer.is_authorized(self, user, "read", AUTH_RESOURCE)
        if not await ensure_async(allowed):
            raise web.HTTPError(403, f"not authorized to read {AUTH_RESOURCE}")
        raw = self.get_argument("interval", None)
        try:
            self.interval = clamp_interval(raw) if raw is not None else DEFAULT_INTERVAL
        except ValueError as e:
            raise web.HTTPError(400, str(e))
        self._last_sent = 0.0
        self._pending: Any = None
        self._feed_pending: Any = None
        return await super().get(*args, **kwargs)

    async def open(self, *args: Any, **kwargs: Any) -> None:
        super().open(*args, **kwargs)  # starts the keep-alive pings
        snap = await asyncio.get_running_loop().run_in_executor(
            self.state.executor, self.state.telemetry, 60)
        self._send({"type": "snapshot", "interval": self.interval, **snap})
        await self.state.hub.add(self)

    def on_message(self, message: str | bytes) -> None:
        try:
            msg = json.loads(message)
        except ValueError:
            msg = None
        if isinstance(msg, dict) and "follow" in msg:
            asyncio.ensure_future(self._follow(msg))
        elif isinstance(msg, dict) and "unfollow" in msg:
            self.state.feeds.unfollow(self, str(msg["unfollow"]))
        elif isinstance(msg, dict) and "interval" in msg:
            try:
                self.interval = clamp_interval(msg["interval"])
            except ValueError as e:
                self._send({"type": "error", "error": str(e)})
                return
            self.state.hub.retune()
            self._send({"type": "interval", "interval": self.interval})
        else:
            self._send({"type": "error", "error": (
                f'message: got {str(message)[:80]!r}; expected a JSON object {{"interval": '
                f'seconds}}, {{"follow": run_id, "after": seq, "logs": {{file: offset}}}} or '
                f'{{"unfollow": run_id}}')})

    async def _follow(self, msg: dict) -> None:
        run_id = msg.get("follow")
        try:
            after, logs = _follow_args(msg)
            await self.state.feeds.follow(self, run_id, after, logs)
        except KeyError:
            self._send({"type": "error", "run": run_id,
                        "error": f"follow: no run with id {run_id!r} in the registry"})
        except sqlite3.DatabaseError as e:
            self._send({"type": "error", "run": run_id,
                        "error": str(registry_http_error(e, self.state).log_message)})
        except ValueError as e:
            self._send({"type": "error", "run": run_id, "error": str(e)})

    def offer(self, message: str, now: float) -> None:
        """Called by the hub on the IOLoop for every new sample."""
        # 10% slack: samples arrive with scheduling jitter, and a client whose interval equals the
        # sampler's must get every sample, not every other one
        if now - self._last_sent < 0.9 * self.interval:
            return
        if self._pending is not None and not self._pending.done():
            return  # the previous message has not left the socket: drop, don't queue
        try:
            self._pending = self.write_message(message)
        except websocket.WebSocketClosedError:
            return
        self._last_sent = now
        self.state.hub.messages_sent += 1

    def feed_send(self, message: str) -> bool:
        """Called by the run feeds; False (the feed catches this client up later) while the
        previous feed message has not left the socket, so nothing piles up in the server."""
        if self._feed_pending is not None and not self._feed_pending.done():
            return False
        try:
            self._feed_pending = self.write_message(message)
        except websocket.WebSocketClosedError:
            return False
        return True

    def _send(self, payload: dict) -> None:
        try:
            self.write_message(json.dumps(payload))
        except websocket.WebSocketClosedError:
            pass

    def on_close(self) -> None:
        self.state.feeds.unfollow(self)
        asyncio.ensure_future(self.state.hub.remove(self))


def _follow_args(msg: dict) -> tuple[int, dict[str, int]]:
    """(after, logs) of a follow message, checked: a run id, a seq >= 0, log offsets >= 0."""
    run_id, after, logs = msg.get("follow"), msg.get("after", 0), msg.get("logs") or {}
    if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id):
        raise ValueError(f"follow: got run id {str(run_id)[:80]!r}; expected letters, digits, "
                         "'.', '_' or '-'")
    if isinstance(after, bool) or not isinstance(after, int) or after < 0:
        raise ValueError(f"follow: got after={after!r}; expected a sequence number >= 0")
    if not isinstance(logs, dict) or len(logs) > 256:
        raise ValueError("follow: logs must be an object {file: byte offset}")
    for name, offset in logs.items():
        runview.check_log_name(name)
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"follow: got offset {offset!r} for {name}; expected bytes >= 0")
    return after, logs


def handlers(base_url: str) -> list[tuple[str, type]]:
    def u(path: str) -> str:
        return url_path_join(base_url, path)

    return [
        (u("gpu-lab/api/info"), InfoHandler),
        (u("gpu-lab/api/telemetry"), TelemetryHandler),
        (u("gpu-lab/api/telemetry/ws"), LiveWebSocket),
        (u("gpu-lab/api/runs"), RunsHandler),
        (u(f"gpu-lab/api/runs/{_RUN_ID}"), RunHandler),
        (u(f"gpu-lab/api/runs/{_RUN_ID}/events"), RunEventsHandler),
        (u(f"gpu-lab/api/runs/{_RUN_ID}/logs/(?P<name>[A-Za-z0-9._-]{{1,64}})"), RunLogHandler),
        (u(f"gpu-lab/api/runs/{_RUN_ID}/stop"), StopRunHandler),
        (u(f"gpu-lab/api/runs/{_RUN_ID}/checkpoint"), CheckpointHandler),
        (u(f"gpu-lab/api/runs/{_RUN_ID}/resume"), ResumeHandler),
        (u("gpu-lab/api/compare"), CompareHandler),
        (u("gpu-lab/metrics"), MetricsHandler),
    ]

