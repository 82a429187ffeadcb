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
from typing import Any, Callable

from jupyter_core.utils import ensure_async
from jupyter_server.auth.decorator import authorized, ws_authenticated
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from jupyter_server.base.websocket import WebSocketMixin
from jupyter_server.utils import url_path_join
from tornado import web, websocket

from .hub import DEFAULT_INTERVAL, MAX_HISTORY, clamp_interval
from .state import ServerState

AUTH_RESOURCE = "gpu_lab"
_RUN_ID = r"(?P<run_id>[A-Za-z0-9._-]{1,128})"


class _Base(APIHandler):
    auth_resource = AUTH_RESOURCE

    @property
    def state(self) -> ServerState:
        return self.settings["gpu_lab"]

    async def off_loop(self, fn: Callable, *args: Any) -> Any:
        """Run blocking work (SQLite, NVML, signalling) in the extension's thread pool."""
        return await asyncio.get_running_loop().run_in_executor(
            self.state.executor, functools.partial(fn, *args))

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
        runs = await self.off_loop(self.state.list_runs, limit)
        self.finish(json.dumps({"runs": runs}))


class RunHandler(_Base):
    @web.authenticated
    @authorized
    async def get(self, run_id: str) -> None:
        points = self.int_arg("points", 500, 4, 5000)
        run = await self.off_loop(self.state.get_run, run_id, points)
        if run is None:
            raise web.HTTPError(404, f"no run with id {run_id!r} in the registry")
        self.finish(json.dumps(run))


class StopRunHandler(_Base):
    @web.authenticated
    @authorized
    async def post(self, run_id: str) -> None:
        try:
            run = await self.off_loop(self.state.stop_run, run_id)
        except KeyError:
            raise web.HTTPError(404, f"no run with id {run_id!r} in the registry")
        self.finish(json.dumps(run))


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


class TelemetryWebSocket(WebSocketMixin, websocket.WebSocketHandler, JupyterHandler):
    """Streams telemetry samples. The client may send {"interval": seconds} at any time; the
    interval is clamped to at least 0.25 s. Query parameter ?interval= sets the initial value."""

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
        return await super().get(*args, **kwargs)

    async def open(self, *args: Any, **kwargs: Any) -> None:
        super().open(*args, **kwargs)  # starts the keep-alive pings
        snap = await asyncio.get_running_loop().run_in_executor(
            self.state.executor, self.state.telemetry, 60)
        self._send({"type": "snapshot", "interval": self.interval, **snap})
        await self.state.hub.add(self)

    def on_message(self, message: str | bytes) -> None:
        try:
            try:
                msg = json.loads(message)
            except ValueError:
                msg = None
            if not isinstance(msg, dict) or "interval" not in msg:
                raise ValueError(f'message: got {str(message)[:80]!r}; expected a JSON object '
                                 f'{{"interval": seconds}}')
            self.interval = clamp_interval(msg["interval"])
        except ValueError as e:
            self._send({"type": "error", "error": str(e)})
            return
        self.state.hub.retune()
        self._send({"type": "interval", "interval": self.interval})

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

    def _send(self, payload: dict) -> None:
        try:
            self.write_message(json.dumps(payload))
        except websocket.WebSocketClosedError:
            pass

    def on_close(self) -> None:
        asyncio.ensure_future(self.state.hub.remove(self))


def handlers(base_url: str) -> list[tuple[str, type]]:
    def u(path: str) -> str:
        return url_path_join(base_url, path)

    return [
        (u("gpu-lab/api/info"), InfoHandler),
        (u("gpu-lab/api/telemetry"), TelemetryHandler),
        (u("gpu-lab/api/telemetry/ws"), TelemetryWebSocket),
        (u("gpu-lab/api/runs"), RunsHandler),
        (u(f"gpu-lab/api/runs/{_RUN_ID}"), RunHandler),
        (u(f"gpu-lab/api/runs/{_RUN_ID}/stop"), StopRunHandler),
        (u("gpu-lab/metrics"), MetricsHandler),
    ]

