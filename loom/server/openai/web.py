"""The page at `/` on the HTTP port: a live dashboard and a chat playground, three files inside
the package (loom/server/web/: nothing fetched from elsewhere), off with `--no-web-ui`.

    GET /              the page            GET /ui/app.js, /ui/style.css   its script, its style
    GET /stats         the engine's figures as the caller may see them (JSON), for the page

The files hold no data and need no key; the page asks for one (kept in the tab's session) when
`/stats` or the API answers 401, and sends it with every request, as any client does. `/stats`
is the engine's stats under the API's keys: an admin's are every tenant's, anyone else's their
own (loom.v1's GetServerStats, in JSON). The `Host` rules are the front's, for every route; a
request for the page from another web origin (its `Origin` neither the page's own nor one of
`--allowed-origins`) is refused 403. The page's Content-Security-Policy lets it load and call
nothing but this server, and be framed by no one.
"""

from __future__ import annotations

import importlib.resources
from typing import Any

import attrs

from loom.engine.stats import EngineStats
from loom.server.openai.errors import HttpError
from loom.server.openai.message import HttpRequest
from loom.server.openai.origin_policy import OriginPolicy

FILES = {"/": "index.html", "/ui/app.js": "app.js", "/ui/style.css": "style.css"}
TYPES = {
    "html": "text/html; charset=utf-8",
    "js": "text/javascript; charset=utf-8",
    "css": "text/css; charset=utf-8",
}
POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
NOT_STORED = {"Cache-Control": "no-store"}  # /stats: figures of the moment, and a tenant's
GUARDS = {
    "Content-Security-Policy": POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class WebPage:
    """The page's files, read once, and whom they are served to."""

    def __init__(self, origins: OriginPolicy) -> None:
        self.origins = origins
        folder = importlib.resources.files("loom.server") / "web"
        self.files = {path: (folder / name).read_bytes() for path, name in FILES.items()}

    def file(self, request: HttpRequest) -> tuple[bytes, dict[str, str]]:
        """A file of the page and its headers, or 403 for another origin's request."""
        origin, host = request.headers.get("origin"), request.headers.get("host")
        own = host is not None and origin in (f"http://{host}", f"https://{host}")
        if origin is not None and not own and not self.origins.cors(origin):
            raise HttpError(403, f"the page is not served to the origin {origin[:200]!r}")
        kind = FILES[request.path].rpartition(".")[2]
        return self.files[request.path], {"Content-Type": TYPES[kind], **GUARDS}


def stats_document(stats: EngineStats, model: str, state: str, admin: bool) -> dict[str, Any]:
    """The figures the dashboard shows: the engine's stats as the caller may see them."""
    return {"model": model, "state": state, "admin": admin, **attrs.asdict(stats)}
