"""A read-only HTTP server for what a process shows about itself: the status page (runtime.dashboard)
and a peer's /metrics (runtime.metrics).

    server = ReadOnlyServer({"/metrics": lambda: (CONTENT_TYPE, body)}, "127.0.0.1", 0, max_clients=8)
    server.url("/metrics")                  # http://127.0.0.1:PORT/metrics
    server.close()

Network input is hostile and the process never waits on this server: it runs in daemon threads,
answers GET and HEAD of its routes only (404 for any other path, 501 for any other method), serves at
most `max_clients` connections at once (more are closed unanswered, nothing queued), gives a client
`CLIENT_TIMEOUT_S` per read or write and `CLIENT_DEADLINE_S` for its whole connection, and keeps
http.server's limits on the request line and headers. A route that raises answers 500.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from lowcomm.version import __version__

logger = logging.getLogger(__name__)
CLIENT_TIMEOUT_S = 5.0
CLIENT_DEADLINE_S = 10.0
Route = Callable[[], tuple[str, bytes]]  # () -> (Content-Type, body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client never holds up the process's exit
    allow_reuse_address = True

    def __init__(self, address, routes: dict[str, Route], max_clients: int, not_found: bytes):
        self.routes, self.not_found = routes, not_found
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.slots = threading.BoundedSemaphore(max_clients)
        self.refused = 0
        super().__init__(address, _Handler)

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):  # a flood of connections: refused, nothing queued
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        # the whole connection's deadline: a client dripping bytes within each read's timeout is cut off too
        cutoff = threading.Timer(CLIENT_DEADLINE_S, _cut, args=(request,))
        cutoff.daemon = True
        cutoff.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            cutoff.cancel()
            self.slots.release()

    def handle_error(self, request, client_address) -> None:  # a client's broken or slow connection: no traceback
        logger.debug("HTTP client %s: connection failed", client_address, exc_info=True)


def _cut(request: socket.socket) -> None:
    try:
        request.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Handler(BaseHTTPRequestHandler):
    timeout = CLIENT_TIMEOUT_S
    server: _Server
    server_version = f"lowcomm/{__version__}"

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        route = self.server.routes.get(self.path.split("?", 1)[0])
        if route is None:
            self._send(404, "text/plain; charset=utf-8", self.server.not_found, body)
            return
        try:
            kind, data = route()
        except Exception as e:  # a bug behind one route must not take the server down
            logger.warning("HTTP %s failed: %s", self.path[:100], e)
            self._send(500, "text/plain; charset=utf-8", b"internal error; see the process's log\n", body)
            return
        self._send(200, kind, data, body)

    def _send(self, code: int, kind: str, data: bytes, body: bool) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format, *args) -> None:  # no line per request on the console
        logger.debug("HTTP: " + format, *args)


class ReadOnlyServer:
    """Serves `routes` on host:port (0: a free port) in a daemon thread until `close()`; OSError if it
    cannot listen."""

    def __init__(self, routes: dict[str, Route], host: str, port: int, max_clients: int, not_found: bytes,
                 name: str = "http"):
        self.server = _Server((host, port), routes, max_clients, not_found)
        self.host, self.port = host, self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                        daemon=True, name=name)
        self._thread.start()
        self._closed = False

    def url(self, path: str = "/") -> str:
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}{path}"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)
