"""The OpenAI-compatible HTTP gateway, split as vLLM splits its entrypoints: request bodies
(`models`), error replies (`errors`), response objects and SSE (`replies`), what each route does
(`handlers`), and the routes and server (`app`). docs/gateway.md describes it.
"""

from daemon.fronts.http.app import HttpGateway, build_app
from daemon.fronts.http.handlers import Gateway

__all__ = ["Gateway", "HttpGateway", "build_app"]
