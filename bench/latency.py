"""A TCP proxy on loopback that adds a fixed delay to every request: simulated storage latency.

Each chunk the client sends (with HTTP keep-alive, one S3 GET is one chunk: a
request line and headers, no body) is held for ``delay`` seconds before it is
forwarded; replies flow back at once. So every object read costs one extra
``delay`` of round-trip time, as a remote object store would, while the bytes
still come from the local SeaweedFS.
"""

from __future__ import annotations

import socket
import threading
import time

__all__ = ["DelayProxy"]


class DelayProxy:
    """``with DelayProxy(("127.0.0.1", port), 0.005) as proxy: proxy.endpoint``."""

    def __init__(self, target: tuple[str, int], delay: float):
        self.target, self.delay = target, delay
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = False

    def __enter__(self) -> DelayProxy:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pipe, args=(client, server, self.delay),
                             daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, 0.0), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket, delay: float) -> None:
        try:
            while chunk := source.recv(1 << 16):
                if delay:
                    time.sleep(delay)
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
