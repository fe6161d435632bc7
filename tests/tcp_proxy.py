"""A TCP proxy on 127.0.0.1 that can be cut, black-holed and restored: a real network outage
in front of a server (the moto S3 server, PostgreSQL), for the storage and chaos tests.

Three states:
- ``up``: forwards every connection to the target;
- ``cut()``: every open connection is reset and new ones are reset at once (the server looks
  down: clients fail fast);
- ``blackhole()``: open connections go silent and new ones are accepted and never answered (a
  dropped route: every call waits for its timeout);
- ``restore()``: forwards again.
The listening socket stays open throughout, so the port never changes and no other process can
take it while the proxy is cut.
"""
from __future__ import annotations

import socket
import struct
import threading
from urllib.parse import urlsplit, urlunsplit

from bench import ports

_RST = struct.pack("ii", 1, 0)      # SO_LINGER on, 0 s: close() sends a reset


class TcpProxy:
    """TCP forwarder 127.0.0.1:<port> -> ``target`` with the states up, cut, blackhole."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._ls = ports.listener(256, reuse_addr=True)
        self.port: int = self._ls.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.state = "up"
        self.connections = 0                 # accepted so far (all states)
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._muted: set[socket.socket] = set()      # black-holed: silent until closed
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name=f"tcp-proxy-{self.port}").start()

    # -- control ---------------------------------------------------------------------------
    def cut(self) -> None:
        """Reset every connection, open and new."""
        self.state = "cut"
        self._drop_all()

    def blackhole(self) -> None:
        """Accept connections and never answer; open ones go silent too (for good: what
        their clients send is dropped, nothing comes back, they are never closed here)."""
        self.state = "blackhole"
        with self._lock:
            self._muted |= self._conns

    def restore(self) -> None:
        """Forward again (connections made while cut or black-holed stay dead)."""
        self.state = "up"

    def close(self) -> None:
        """Stop for good: the listener and every connection."""
        self._closed = True
        self._drop_all()
        try:
            self._ls.close()
        except OSError:
            pass

    def _drop_all(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, set()
            self._muted = set()
        for c in conns:
            _reset(c)

    # -- forwarding ------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._ls.accept()
            except OSError:
                return
            self.connections += 1
            state = self.state
            if state == "cut":
                _reset(client)
                continue
            with self._lock:
                self._conns.add(client)
            if state == "blackhole":
                with self._lock:
                    self._muted.add(client)
                continue                             # held open, never answered
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                with self._lock:
                    self._conns.discard(client)
                _reset(client)
                continue
            with self._lock:
                self._conns.add(upstream)
            if self.state == "cut":                  # cut while we were connecting
                self._drop_all()
                continue
            if self.state == "blackhole":            # black-holed meanwhile: silent
                with self._lock:
                    self._muted |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data or self.state == "cut":
                    break
                if src in self._muted or dst in self._muted:
                    continue                         # black-holed: swallow, answer nothing
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)
                self._muted.discard(src)
                self._muted.discard(dst)
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass


def _reset(s: socket.socket) -> None:
    """Reset ``s``. close() alone does not wake a pump thread blocked in recv() on it (Linux
    keeps the socket open while a call uses it): the peer would never hear of the cut and a
    client waiting for an answer would hang forever. shutdown(SHUT_RD) wakes that recv()
    (sends nothing); the socket is then released with SO_LINGER 0, i.e. reset."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST)
    except OSError:
        pass
    try:
        s.shutdown(socket.SHUT_RD)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass


def proxied_url(url: str) -> tuple[TcpProxy, str]:
    """A TcpProxy in front of a server URL's host and port (a PostgreSQL database), and the same
    URL pointed at the proxy (the user kept): cut the proxy to cut that server."""
    u = urlsplit(url)
    proxy = TcpProxy(u.hostname, u.port)
    return proxy, urlunsplit(u._replace(netloc=f"{u.username}@127.0.0.1:{proxy.port}"))
