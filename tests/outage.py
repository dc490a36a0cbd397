"""An S3 endpoint that goes down: a TCP relay on loopback in front of the test session's moto
server, whose state (buckets, objects) it leaves alone.

While down, its port refuses connections and every connection open through it is reset, as
when the endpoint's process stops; `up()` listens on the same port again. `down_on` takes it
down by itself the moment a request it relays matches a pattern (a checkpoint file's PUT, the
run state's, the lease's n-th), for a given time: an outage that hits exactly that write.
"""

from __future__ import annotations

import re
import socket
import struct
import threading
import time
from urllib.parse import urlparse


class FlakyEndpoint:
    def __init__(self, upstream: str):
        parsed = urlparse(upstream)
        self._upstream = (parsed.hostname, parsed.port)
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._trigger: tuple[re.Pattern, int, float] | None = None
        self.port = 0
        self.hit: bytes | None = None  # the request line that took it down
        self.outages: list[tuple[float, float]] = []  # (down, up) by time.monotonic()
        self.up()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        listener.settimeout(0.1)
        self.port = listener.getsockname()[1]
        with self._lock:
            self._listener = listener
            if self.outages and self.outages[-1][1] == 0.0:
                self.outages[-1] = (self.outages[-1][0], time.monotonic())
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._open = list(self._open), set()
            self.outages.append((time.monotonic(), 0.0))
        if listener is not None:
            listener.close()
        for conn in conns:
            _reset(conn)

    def outage(self, seconds: float) -> None:
        """Down now, up again in `seconds`."""
        self.down()
        threading.Timer(seconds, self.up).start()

    def down_on(self, pattern: bytes, seconds: float, nth: int = 1) -> None:
        """Go down for `seconds` at the `nth` request whose bytes match `pattern` (a regex);
        that request is never relayed."""
        self._trigger = (re.compile(pattern), nth, seconds)

    def wait_up(self, timeout_s: float = 60.0) -> None:
        """Until the outage has ended."""
        deadline = time.monotonic() + timeout_s
        while self._listener is None:
            assert time.monotonic() < deadline, "the endpoint stayed down"
            time.sleep(0.05)

    def close(self) -> None:
        self._trigger = None
        self.down()

    def _accept(self, listener: socket.socket) -> None:
        while self._listener is listener:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._upstream, timeout=5)
            except OSError:
                _reset(conn)
                continue
            conn.settimeout(None)
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not listener:  # went down meanwhile
                    _reset(conn)
                    _reset(upstream)
                    return
                self._open |= {conn, upstream}
            threading.Thread(target=self._pump, args=(conn, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, conn, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        try:
            while data := src.recv(65536):
                if requests and self._fires(data):
                    return
                dst.sendall(data)
        except OSError:
            pass  # reset by an outage, or by the other side
        finally:
            with self._lock:
                self._open -= {src, dst}
            _reset(src)
            _reset(dst)

    def _fires(self, data: bytes) -> bool:
        trigger = self._trigger
        if trigger is None:
            return False
        pattern, nth, seconds = trigger
        match = pattern.search(data)
        if match is None:
            return False
        with self._lock:
            if self._trigger is not trigger:
                return False
            if nth > 1:
                self._trigger = (pattern, nth - 1, seconds)
                return False
            self._trigger = None
            self.hit = data[: data.find(b"\r\n")] if b"\r\n" in data else data[:200]
        self.outage(seconds)
        return True


def _reset(sock: socket.socket) -> None:
    """Close with a reset (RST), not a polite FIN: as a process that died."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed or reset
    sock.close()
