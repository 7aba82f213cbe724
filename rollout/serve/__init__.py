"""HTTP rollout server: `python -m rollout.serve` (or `rollout-serve`).

OpenAI-compatible routes with vLLM's extensions, a native token-in / token-out `/generate`, control
and weight routes, over one engine loop (`loop.EngineLoop`): on a thread of the server's process
(given a RolloutWorker) or in a process of its own (given a `remote.EngineProcess`). See the README, "Serve over HTTP".
"""
from __future__ import annotations

import socket
import threading
from typing import Optional

import uvicorn

from .app import ServeOptions, build_app

__all__ = ["ServeOptions", "UvicornServer", "build_app", "serve", "start_in_thread"]


class UvicornServer(uvicorn.Server):
    async def shutdown(self, sockets=None):
        # answer open requests first (partial outputs, "abort"): shutdown never waits on a long generation
        server = self.config.app.state.server
        server.closing = True
        server.loop.post("fail_pending")
        await super().shutdown(sockets)


def _config(app, host: str, port: int, log_level: str) -> uvicorn.Config:
    opts = app.state.server.opts
    # uvicorn answers 503 once the open connections, the asking one included, reach its limit: +1 so that
    # max_connections connections are served
    limit = None if opts.max_connections is None else opts.max_connections + 1
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10,
                          timeout_keep_alive=opts.keep_alive_s, limit_concurrency=limit, lifespan="on")


def serve(engine, opts: Optional[ServeOptions] = None, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> None:
    """Serve `engine` (a RolloutWorker or an EngineProcess) until SIGINT / SIGTERM."""
    UvicornServer(_config(build_app(engine, opts), host, port, log_level)).run()


def start_in_thread(engine, opts: Optional[ServeOptions] = None, host: str = "127.0.0.1",
                    log_level: str = "warning") -> tuple[UvicornServer, threading.Thread, str]:
    """Serve on a free port from a background thread (tests, benchmarks); returns (server, thread,
    base_url). Stop with `server.should_exit = True; thread.join()`."""
    sock = socket.socket()
    sock.bind((host, 0))
    server = UvicornServer(_config(build_app(engine, opts), host, sock.getsockname()[1], log_level))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="rollout-http", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the HTTP server failed to start")
        threading.Event().wait(0.01)
    return server, thread, f"http://{host}:{sock.getsockname()[1]}"
