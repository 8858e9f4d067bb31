"""``--inject metaserver-down``: the metaserver unreachable for a while, then back (F1).

A TCP relay stands in front of the proxy's metaserver endpoint. Its first ``cuts``
connections are reset as soon as they are accepted - what a client sees from a metaserver
that is down or restarting - and every later one is forwarded to the real proxy byte for
byte. Decode posts its rendezvous through the relay, so the run shows the rendezvous client
retrying transport errors (F1) until the metaserver is back; the count of cut connections is
what the run observed, not what it was told.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
import urllib.parse

#: One read or write of a relayed connection; a stalled side ends the connection.
RELAY_IO_S = 5.0
_CHUNK = 1 << 16


class FlakyRelay:
    """Listens on ``host``:random port; ``close()`` stops everything within its deadline."""

    def __init__(self, host: str, target_url: str, cuts: int) -> None:
        parts = urllib.parse.urlsplit(target_url)
        self._target = (parts.hostname or host, parts.port or 80)
        self._server = socket.create_server((host, 0), backlog=128)
        port = self._server.getsockname()[1]
        self.url = urllib.parse.urlunsplit(parts._replace(netloc=f"{host}:{port}"))
        self.cuts_left = cuts
        self.cut = 0  # connections reset while "down"
        self.forwarded = 0  # connections relayed once "up" again
        self._lock = threading.Lock()
        self._closing = False
        self._threads: list[threading.Thread] = []
        self._open: set[socket.socket] = set()
        self._accept = threading.Thread(target=self._serve, name="relay-accept", daemon=True)
        self._accept.start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # close() shut the listening socket down
            with self._lock:
                if self._closing:
                    client.close()
                    return
                down = self.cuts_left > 0
                if down:
                    self.cuts_left -= 1
                    self.cut += 1
            if down:
                # SO_LINGER 0: close() sends RST, the client's request fails at once.
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()
                continue
            t = threading.Thread(target=self._forward, args=(client,), name="relay-conn",
                                 daemon=True)
            with self._lock:
                self.forwarded += 1
                self._threads.append(t)
            t.start()

    def _forward(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self._target, timeout=RELAY_IO_S)
        except OSError:
            client.close()
            return
        with self._lock:
            self._open.update((client, upstream))
        client.settimeout(RELAY_IO_S)
        back = threading.Thread(target=_pump, args=(upstream, client), name="relay-back",
                                daemon=True)
        back.start()
        _pump(client, upstream)
        back.join(RELAY_IO_S)
        with self._lock:
            self._open.difference_update((client, upstream))
        client.close()
        upstream.close()

    def close(self, timeout: float = RELAY_IO_S) -> bool:
        """Stop accepting, cut open connections; True when every thread ended in time."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._closing = True
            socks = list(self._open)
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self._server.close()
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._accept.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not self._accept.is_alive() and not any(t.is_alive() for t in threads)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy until EOF or an error on either side, then pass the EOF on."""
    try:
        while data := src.recv(_CHUNK):
            dst.sendall(data)
    except OSError:
        pass
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass
