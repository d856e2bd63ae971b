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


def call(app: Any, path: str, method: str = "GET", *, form: dict[str, str] | None = None,
         headers: dict[str, str] | None = None, cookie: str | None = None) -> Reply:
    path_info, _, query = path.partition("?")
    body = urllib.parse.urlencode(form or {}).encode()
    environ: dict[str, Any] = {"PATH_INFO": path_info, "QUERY_STRING": query, "REQUEST_METHOD": method,
                               "wsgi.input": io.BytesIO(body), "CONTENT_LENGTH": str(len(body)),
                               "CONTENT_TYPE": "application/x-www-form-urlencoded", "HTTP_HOST": "127.0.0.1:8080"}
    for k, v in (headers or {}).items():
        environ["HTTP_" + k.upper().replace("-", "_")] = v
    if cookie:
        environ["HTTP_COOKIE"] = cookie
    setup_testing_defaults(environ)
    got: dict[str, Any] = {}

    def start_response(status: str, hdrs: list[tuple[str, str]]) -> None:
        got["status"], got["headers"] = status, hdrs

    out = b"".join(app(environ, start_response))
    hdrs = got["headers"]
    return Reply(int(got["status"].split()[0]), dict(hdrs), out.decode(),
                 [v for k, v in hdrs if k == "Set-Cookie"])
