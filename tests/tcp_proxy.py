"""A small TCP proxy on loopback for fault tests: forwards, stalls (keeps every connection open
and accepts new ones, but forwards nothing: a hung path the kernel still acknowledges), or goes
down (closes every connection and refuses new ones) and comes back on the same port."""
from __future__ import annotations

import socket
import threading
from typing import Self


class TcpProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1", port: int = 0) -> None:
        self.target = (target_host, target_port)
        self._flowing = threading.Event()
        self._flowing.set()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.port = port
        self.up()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.down()
        self._flowing.set()

    def stall(self) -> None:
        self._flowing.clear()

    def flow(self) -> None:
        self._flowing.set()

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        """Close the listener and every connection (their peers see them closed)."""
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._open = self._open, set()
        for s in ([listener] if listener else []) + list(conns):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by down()
            try:
                server = socket.create_connection(self.target, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    server.close()
                    return
                self._open |= {client, server}
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                self._flowing.wait()
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
