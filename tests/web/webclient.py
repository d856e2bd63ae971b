"""A tiny in-process WSGI client for the dashboard tests (no server, no framework)."""

from __future__ import annotations

import io
import json
import urllib.parse
from dataclasses import dataclass, field
from typing import Any
from wsgiref.util import setup_testing_defaults


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: str
    cookies: list[str] = field(default_factory=list)

    def json(self) -> Any:
        assert self.headers["Content-Type"] == "application/json", self.headers
        return json.loads(self.body)


def _wsgi(text: str) -> str:
    """A request's text as a WSGI server hands it over (PEP 3333): its UTF-8 bytes read as latin-1."""
    return text.encode("utf-8").decode("latin-1")


def call(app: Any, path: str, method: str = "GET", *, form: dict[str, str] | None = None,
         headers: dict[str, str] | None = None, cookie: str | None = None) -> Reply:
    """Send ``path`` (a URL's path and query, as a browser writes it: percent-encoded or not)
    as a WSGI server does: PATH_INFO percent-decoded (so ``%2F`` arrives as ``/``), the query
    as sent, every value the bytes it was read as latin-1."""
    path_info, _, query = path.partition("?")
    body = urllib.parse.urlencode(form or {}).encode()
    environ: dict[str, Any] = {"PATH_INFO": urllib.parse.unquote_to_bytes(path_info).decode("latin-1"),
                               "QUERY_STRING": _wsgi(query), "REQUEST_METHOD": method,
                               "wsgi.input": io.BytesIO(body), "CONTENT_LENGTH": str(len(body)),
                               "CONTENT_TYPE": "application/x-www-form-urlencoded", "HTTP_HOST": "127.0.0.1:8080"}
    for k, v in (headers or {}).items():
        environ["HTTP_" + k.upper().replace("-", "_")] = _wsgi(v)
    if cookie:
        environ["HTTP_COOKIE"] = _wsgi(cookie)
    setup_testing_defaults(environ)
    got: dict[str, Any] = {}

    def start_response(status: str, hdrs: list[tuple[str, str]]) -> None:
        got["status"], got["headers"] = status, hdrs

    out = b"".join(app(environ, start_response))
    hdrs = got["headers"]
    return Reply(int(got["status"].split()[0]), dict(hdrs), out.decode(),
                 [v for k, v in hdrs if k == "Set-Cookie"])
