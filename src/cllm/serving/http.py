"""The connection side of `cllm serve`: uvicorn's HTTP/1.1 (h11) protocol with the limits an open
port needs and uvicorn does not have.

- A client has `header_timeout` seconds, from connecting or from its previous response, to send
  a whole request head; one that trickles its headers (slowloris) is closed.
- At most `max_connections` connections stay open: a newcomer beyond it closes the connection
  that has waited longest without a request in progress (never one whose request runs), so
  idle or half-open connections cannot lock everyone out, and GET /health keeps answering.

Idle keep-alive connections close after uvicorn's own `timeout_keep_alive`. This subclasses
uvicorn's `H11Protocol` (an extension point: `uvicorn.Config(http=...)` takes a protocol class)
and reads three of its attributes; `check_uvicorn` refuses a uvicorn whose protocol lacks them.
"""

from __future__ import annotations

import asyncio
import logging
import resource

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from cllm.core.errors import UserError

log = logging.getLogger(__name__)

def check_uvicorn() -> None:
    """A one-line UserError when the installed uvicorn's h11 protocol is not the one this module
    was written against (0.29 to 0.54 were)."""
    missing = [name for name in ("on_response_complete", "handle_events", "connection_made")
               if not hasattr(H11Protocol, name)]
    if missing:
        raise UserError(f"uvicorn {uvicorn.__version__}'s H11Protocol lacks {', '.join(missing)}: "
                        "install uvicorn>=0.29,<0.60 for cllm serve")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on request heads and a cap on open connections
    (set the class attributes in a subclass: `guarded_protocol`)."""

    header_timeout: float = 10.0
    max_connections: int = 1024

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._arm()
        if len(self.connections) > self.max_connections:
            self._evict()

    def handle_events(self) -> None:
        super().handle_events()
        if not self.idle:  # a request head arrived: its body and answer have their own limits
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.idle and not self.transport.is_closing():  # the next head gets the same deadline
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    @property
    def idle(self) -> bool:
        """No request in progress: waiting for a head (a first one, or the next)."""
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self.idle_since = self.loop.time()
        self._timer = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if getattr(self, "_timer", None) is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self.idle and not self.transport.is_closing():
            log.info("closed a connection that sent no whole request head in %g s", self.header_timeout)
            self.transport.close()

    def _evict(self) -> None:
        """Close the connection idle the longest (this newcomer when every other one is busy)."""
        idle = [c for c in self.connections if isinstance(c, GuardedH11Protocol) and c.idle and c is not self
                and not c.transport.is_closing()]
        victim = min(idle, key=lambda c: c.idle_since) if idle else self
        log.info("%d connections open (--max-connections): closed the one idle the longest", len(self.connections))
        victim.transport.close()


SPARE_FILES = 256  # file descriptors kept for the model's files, logs, the listening socket


def room_for_connections(wanted: int) -> int:
    """How many connections the process can hold open: `wanted`, after raising the soft limit
    on open files towards the hard one if needed, else what the limit leaves (logged). A cap
    above the limit would let accept() fail before the cap evicts anyone."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + SPARE_FILES
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    room = wanted if soft == resource.RLIM_INFINITY else min(wanted, soft - SPARE_FILES)
    if room < wanted:
        log.warning("--max-connections %d: the open-file limit (%d) leaves room for %d", wanted, soft, room)
    return max(room, 1)


def guarded_protocol(*, header_timeout: float, max_connections: int) -> type[GuardedH11Protocol]:
    """The protocol class to hand to `uvicorn.Config(http=...)` with these limits."""
    check_uvicorn()
    return type("CllmH11Protocol", (GuardedH11Protocol,),
                {"header_timeout": header_timeout, "max_connections": max_connections})
