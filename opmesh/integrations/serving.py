"""``python -m opmesh serve PATH``: transformers' OpenAI-compatible server with continuous
batching on opmesh (``paged|opmesh``).

It is ``transformers serve PATH --continuous-batching`` with opmesh registered first and the
model loaded with ``attn_implementation="opmesh"``, which continuous batching runs as
``"paged|opmesh"``. transformers' server accepts only its own implementation names, so its model
manager is given one that also accepts opmesh's, while the server is built. Endpoints, request
fields and answers are transformers' own: ``POST /v1/chat/completions`` and ``/v1/completions``
(streaming or not), ``GET /v1/models`` and ``/health``. Needs ``pip install
'transformers[serving]'`` (FastAPI, Uvicorn) and psutil. See docs/transformers.md.
"""

from __future__ import annotations

import json
import signal
import time
from unittest import mock

from .transformers import NAME, register

ROLES = ("system", "developer", "user", "assistant", "tool")


def request_problem(path: str, body) -> str | None:
    """What is wrong with a request's JSON body, as ``"field: ..."`` (None: nothing found).

    transformers' handlers take some malformed bodies as they come and fail inside (a 500), or
    answer them (``max_tokens: -3`` gives an empty answer); these checks answer them with a 400
    that names the field, before the handler runs."""
    if not isinstance(body, dict):
        return f"body: expected a JSON object, got {type(body).__name__}"
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "messages: expected a non-empty list of {role, content} objects"
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                return f"messages: entry {i} needs a role, one of {', '.join(ROLES)}"
            if not isinstance(m.get("content"), (str, list)):
                return f"messages: entry {i} needs a content, text or a list of parts"
    elif not isinstance(body.get("prompt"), str):
        return "prompt: expected a string"
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (type(value) is not int or value < 1):
            return f"{name}: expected a positive integer, got {value!r}"
    number = (int, float)
    temperature = body.get("temperature")
    if temperature is not None and (type(temperature) not in number or not 0 <= temperature <= 2):
        return f"temperature: expected a number from 0 to 2, got {temperature!r}"
    top_p = body.get("top_p")
    if top_p is not None and (type(top_p) not in number or not 0 < top_p <= 1):
        return f"top_p: expected a number in (0, 1], got {top_p!r}"
    if body.get("stream") not in (None, True, False):
        return f"stream: expected true or false, got {body['stream']!r}"
    return None


def _checked(build_server):
    """transformers' ``build_server`` with :func:`request_problem` in front of the two
    completion endpoints."""

    def build(*args, **kwargs):
        from fastapi.responses import JSONResponse

        app = build_server(*args, **kwargs)

        @app.middleware("http")
        async def check(request, call_next):
            path = request.url.path
            if request.method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
                try:
                    body = json.loads(await request.body())
                except ValueError:
                    body = ...  # not JSON: FastAPI's own 422 answers it
                problem = None if body is ... else request_problem(path, body)
                if problem is not None:
                    error = {"message": problem, "type": "invalid_request_error",
                             "param": problem.split(":", 1)[0]}  # fmt: skip
                    return JSONResponse({"error": error}, status_code=400)
            return await call_next(request)

        return app

    return build


def serve(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    dtype: str = "auto",
    num_blocks: int | None = None,
    max_batch_tokens: int | None = None,
    max_memory_percent: float | None = None,
    kv_cache: str | None = None,
    log_level: str = "warning",
    block: bool = True,
):
    """Serves the model directory (or hub id) ``model`` until SIGINT or SIGTERM (``block=False``:
    in a background thread, returning transformers' ``Serve``; stop it with ``kill_server()``).

    ``num_blocks``, ``max_batch_tokens`` and ``max_memory_percent`` size the paged cache as in
    ``transformers.ContinuousBatchingConfig`` (pages of 256 tokens); by default transformers
    gives it a share of the free memory. ``kv_cache``: ``"int8"`` or ``"fp8"`` stores the
    full-attention layers' keys and values quantized (``register(kv_cache=...)``)."""
    try:
        from transformers.cli import serve as hf_serve
        from transformers.cli.serving import model_manager as hf_models
        from transformers.cli.serving import server as hf_server
        from transformers.utils.import_utils import is_serve_available
    except ImportError as error:  # pragma: no cover - transformers missing
        raise ImportError("model: serving needs pip install 'opmesh[transformers]'") from error
    if not is_serve_available():
        raise ImportError(
            "model: serving needs FastAPI, Uvicorn, pydantic and openai: "
            "pip install 'transformers[serving]'"
        )
    register(kv_cache=kv_cache)

    class Models(hf_models.ModelManager):
        """transformers' model manager, taking ``"opmesh"`` besides its own names, and listing
        the model it serves (transformers lists the hub cache's models, and fails without one).
        """

        def get_gen_models(self, cache_dir=None):
            served = {"id": self.force_model, "object": "model", "owned_by": "opmesh"}
            return [served | {"created": int(time.time())}]

        def _validate_args(self):
            own = self.attn_implementation
            self.attn_implementation = None if own == NAME else own
            try:
                super()._validate_args()
            finally:
                self.attn_implementation = own

    checked = _checked(hf_server.build_server)
    with (
        mock.patch.object(hf_models, "ModelManager", Models),
        mock.patch.object(hf_server, "build_server", checked),
    ):
        server = hf_serve.Serve(
            force_model=model,
            continuous_batching=True,
            attn_implementation=NAME,
            device="cpu",
            dtype=dtype,
            cb_num_blocks=num_blocks,
            cb_max_batch_tokens=max_batch_tokens,
            cb_max_memory_percent=max_memory_percent,
            host=host,
            port=port,
            log_level=log_level,
            non_blocking=True,  # uvicorn in a thread; this thread takes the signals
        )
    if block:
        _serve_until_stopped(server, f"{host}:{port}")
    return server


def _serve_until_stopped(server, address: str) -> None:
    """Waits for SIGINT or SIGTERM, then lets uvicorn finish its requests and stops it, the
    batching thread and the model (a clean exit, status 0). A server that stops by itself
    (uvicorn could not listen) raises."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    interrupted = False
    try:
        while server._thread.is_alive():
            server._thread.join(0.5)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.server.should_exit = True
        server._thread.join(timeout=30)
        server.kill_server()
    if not interrupted:
        raise RuntimeError(f"port: the server on {address} stopped by itself (is it in use?)")
