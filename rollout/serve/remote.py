"""The engine loop in a process of its own, so that the HTTP side (parsing, SSE formatting) never takes
the GIL from the step loop. Commands and message batches cross one duplex pipe (pickled); the event
loop reads it when it is readable, and a thread of the engine process reads the other end.

`make_worker` must be picklable (a module-level function, or a functools.partial of one): the engine
process builds its RolloutWorker with it.
"""
from __future__ import annotations

import asyncio
import logging
import os
import multiprocessing as mp
import pickle
import signal
import threading
from typing import Callable

from .loop import EngineLoop, LoopClient

log = logging.getLogger(__name__)


def _picklable(batch: list) -> list:
    """Exceptions that do not pickle (extra constructor arguments) cross as RuntimeError(str)."""
    out = []
    for msg in batch:
        if msg[0] == "reply" and msg[3] is not None:
            msg = msg[:3] + (_exc(msg[3]),)
        elif msg[0] == "event" and msg[2][0] == "error":
            msg = msg[:2] + (("error", _exc(msg[2][1])),)
        out.append(msg)
    return out


def _exc(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _engine_main(make_worker: Callable, conn) -> None:
    # Ctrl-C reaches the whole group: the HTTP process decides, and stops this one in order. SIGTERM
    # (multiprocessing's terminate, a service manager) stops it in order too; so does the pipe's end if
    # the HTTP process dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        worker = make_worker()
    except BaseException as exc:
        conn.send(("failed", _exc(exc)))
        raise
    lock = threading.Lock()

    def send(batch):
        with lock:
            try:
                conn.send(batch)
            except (pickle.PicklingError, TypeError, AttributeError):
                conn.send(_picklable(batch))
            except (BrokenPipeError, OSError):     # the HTTP process is gone: stop
                loop.commands.put(("stop", (), None))

    loop = EngineLoop(worker, send)
    signal.signal(signal.SIGTERM, lambda *_: loop.commands.put(("stop", (), None)))

    def read():
        while True:
            try:
                cmd = conn.recv()
            except (EOFError, OSError):            # the HTTP process is gone
                cmd = ("stop", (), None)
            loop.commands.put(cmd)
            if cmd[0] == "stop":
                return
    conn.send(("ready", None))
    threading.Thread(target=read, name="rollout-engine-pipe", daemon=True).start()
    loop.run()


def pretrained_worker(path: str, config):
    """A RolloutWorker over RolloutEngine.from_pretrained(path, config): `python -m rollout.serve`'s."""
    from ..engine import RolloutEngine
    from ..worker import RolloutWorker
    return RolloutWorker(RolloutEngine.from_pretrained(path, config))


class EngineProcess:
    """An EngineLoop in a spawned process, and this process's LoopClient of it."""

    def __init__(self, make_worker: Callable, start_timeout_s: float = 3600.0):
        self.make_worker, self.start_timeout_s = make_worker, start_timeout_s
        self.conn, self.proc = None, None
        self._send_lock = threading.Lock()
        self._gone = self._stopping = False
        self.client = LoopClient(self._submit, self._alive)

    def _alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive() and not self._gone

    def _submit(self, cmd: tuple) -> None:
        with self._send_lock:
            if self._gone:
                return
            try:
                self.conn.send(cmd)
            except (BrokenPipeError, OSError):
                self._gone = True

    def launch(self) -> None:
        """Start the engine process and wait until its worker is built (weights, graphs)."""
        ours, theirs = mp.Pipe(duplex=True)
        self.proc = mp.get_context("spawn").Process(target=_engine_main, args=(self.make_worker, theirs),
                                                    name="rollout-engine", daemon=True)
        self.proc.start()
        theirs.close()
        self.conn = ours
        if not ours.poll(self.start_timeout_s):
            self.proc.kill()
            raise RuntimeError(f"the engine process did not start within {self.start_timeout_s} s")
        try:
            kind, exc = ours.recv()
        except EOFError:
            raise RuntimeError(f"the engine process exited with {self.proc.exitcode} while starting") from None
        if kind == "failed":
            raise RuntimeError(f"the engine process failed to start: {exc}") from exc

    def start(self, aloop: asyncio.AbstractEventLoop) -> None:
        """Once launched: hand its messages to the client from the event loop."""
        self.client.bind(aloop)
        aloop.add_reader(self.conn.fileno(), self._readable)
        # uvloop's add_reader makes the fd non-blocking; recv() must block till a whole message is in (a step's
        # batch outgrows the pipe buffer), else it raises BlockingIOError mid-message
        os.set_blocking(self.conn.fileno(), True)

    def _readable(self) -> None:
        try:
            while self.conn.poll():
                self.client.receive(self.conn.recv())
        except (EOFError, OSError):
            self._gone = True
            self.client.aloop.remove_reader(self.conn.fileno())
            if not self._stopping:
                log.error("the engine process exited (code %s)", self.proc.exitcode)
            self.client.fail_all(RuntimeError("the engine process exited"))

    def stop(self, timeout: float = 30.0) -> None:
        """Every request answered, then the process exits."""
        self._stopping = True
        self.client.post("stop")
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
            raise RuntimeError("the engine process did not stop within the timeout")
