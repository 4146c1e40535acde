"""`asyncrl view`: a read-only web page over run directories, live while they are written.

The page (static/index.html, view.js, view.css and plotly.js from the installed `plotly` package,
so it works with no internet) polls a small JSON API:

    GET /api/runs                              the runs under ROOT and their state
    GET /api/metrics?run=NAME&offset=BYTES     metrics.jsonl rows from a byte offset (live curves)
    GET /api/events?run=NAME&offset=BYTES      events.jsonl rows (the timeline)
    GET /api/steps?run=NAME                    the steps with recorded samples
    GET /api/samples?run=NAME&step=N           one step's samples, token by token
    GET /api/image?run=NAME&name=FILE          a prompt image of those samples

Every problem with a run directory (missing, malformed, truncated) is a JSON error naming it, or
a `problems` list next to the rows that could be read; the page shows both. With an API key the
API needs it (Bearer or x-api-key); the static files hold no run data and stay open.
"""

from __future__ import annotations

import importlib.resources
import ipaddress
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from asyncrl.errors import UserError
from asyncrl.inference.http_auth import BearerKey
from asyncrl.listening import listening_socket
from asyncrl.view.run_dir import Lines, RunDir, RunProblem, find_runs

STATIC = Path(__file__).parent / "static"
PAGE_FILES = {"index.html": "text/html", "view.js": "text/javascript",
              "view.css": "text/css"}


def plotly_js() -> Path:
    """plotly.js as the `plotly` Python package ships it (no CDN)."""
    try:
        path = importlib.resources.files("plotly") / "package_data" / "plotly.min.js"
    except ModuleNotFoundError as err:
        raise UserError("asyncrl view draws its curves with plotly.js from the `plotly` package:"
                        " pip install plotly") from err
    return Path(str(path))


def _lines(lines: Lines) -> dict[str, Any]:
    return {"rows": lines.rows, "offset": lines.offset, "reset": lines.reset,
            "problems": lines.problems, "partial_tail": lines.partial_tail}


def create_view_app(root: str | Path, api_key: str | None = None) -> FastAPI:
    root = Path(root).resolve()
    find_runs(root)  # a root that is no directory fails here, before the server starts
    app = FastAPI(title="asyncrl view", docs_url=None, redoc_url=None, openapi_url=None)
    plotly = plotly_js()

    def run(name: str) -> RunDir:
        runs = find_runs(root)
        if name not in runs:
            known = ", ".join(runs) or "none"
            raise RunProblem(f"no run named {name!r} under {root}; runs: {known}")
        return RunDir(name, runs[name])

    @app.exception_handler(RunProblem)
    async def problem(request: Request, err: RunProblem) -> JSONResponse:
        return JSONResponse({"error": str(err)}, status_code=err.status)

    @app.exception_handler(OSError)
    async def unreadable(request: Request, err: OSError) -> JSONResponse:
        return JSONResponse({"error": f"cannot read the run directory: {err}"}, status_code=422)

    @app.get("/")
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/favicon.ico")
    def favicon() -> Response:
        return Response(status_code=204)

    @app.get("/static/{name}")
    def static(name: str) -> FileResponse:
        if name == "plotly.min.js":
            return FileResponse(plotly, media_type="text/javascript")
        if name not in PAGE_FILES:
            raise RunProblem(f"no static file {name!r}")
        return FileResponse(STATIC / name, media_type=PAGE_FILES[name])

    @app.get("/api/runs")
    def runs() -> dict[str, Any]:
        found = find_runs(root)
        message = None if found else (
            f"{root} holds no run yet: a run directory has metrics.jsonl, events.jsonl or "
            "config.yaml (asyncrl train writes them); this page updates when one appears")
        return {"root": str(root), "message": message,
                "runs": [RunDir(n, p).status() for n, p in found.items()]}

    @app.get("/api/metrics")
    def metrics(run_name: str = Query(..., alias="run"), offset: int = Query(0, ge=0)
                ) -> dict[str, Any]:
        return _lines(run(run_name).metrics(offset))

    @app.get("/api/events")
    def events(run_name: str = Query(..., alias="run"), offset: int = Query(0, ge=0)
               ) -> dict[str, Any]:
        return _lines(run(run_name).events(offset))

    @app.get("/api/steps")
    def steps(run_name: str = Query(..., alias="run")) -> dict[str, Any]:
        return {"steps": run(run_name).sample_steps()}

    @app.get("/api/samples")
    def samples(run_name: str = Query(..., alias="run"), step: int = Query(..., ge=0)
                ) -> dict[str, Any]:
        return {"step": step, **_lines(run(run_name).samples(step))}

    @app.get("/api/image")
    def image(run_name: str = Query(..., alias="run"), name: str = Query(...)) -> Response:
        return FileResponse(run(run_name).image(name), media_type="image/png")

    app.add_middleware(BearerKey, api_key=api_key, command="asyncrl view",
                       is_open=lambda path: not path.startswith("/api/"))
    return app


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def view(root: str | Path, host: str = "127.0.0.1", port: int = 0,
         api_key: str | None = None) -> None:
    """Serve the page until interrupted; prints "asyncrl view: http://HOST:PORT/" when ready."""
    if not is_loopback(host) and not api_key:
        raise UserError(f"--host {host} makes the view reachable from other machines: give "
                        "--api-key KEY (or ASYNCRL_VIEW_API_KEY) so only those who hold it read "
                        "the runs, or bind 127.0.0.1")
    try:
        app = create_view_app(root, api_key)
    except RunProblem as err:
        raise UserError(str(err)) from None
    sock = listening_socket(host, port, 128)
    bound_host, bound_port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    print(f"asyncrl view: http://{bound_host}:{bound_port}/", flush=True)
    server.run(sockets=[sock])
