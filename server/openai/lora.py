"""The adapters' HTTP endpoints: vLLM's runtime load / unload and llama.cpp's list and
server-wide scales (the generation endpoints take ``model`` = an adapter, or ``lora``).

    POST /v1/load_lora_adapter     {"lora_name": N, "lora_path": P}   admin key   -> 200 / 400 /
                                                                                     409
    POST /v1/unload_lora_adapter   {"lora_name": N}                   admin key   -> 200 / 404
    GET  /lora-adapters            [{"id", "path", "scale"}]          any key
    POST /lora-adapters            [{"id", "scale"}]                  admin key   -> the list

Loading reads a path on the server's disk, so it needs an admin key, and a server started
without ``--admin-api-key`` refuses it (403) rather than letting anyone load files. Unloading
refuses new requests for the adapter at once; the requests in flight finish with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import grpc
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from model_runner.lora.info import AdapterInfo
from server.auth import NotAdminError, Security
from server.frontend import Frontend
from server.openai.fields import HttpError, error_body, http_error
from server.openai.parse import load_body, shown
from server.validation import InvalidRequestError

MAX_BODY_BYTES = 64 * 1024


class LoraRoutes:
    """The endpoints above, over the front's ``Adapters`` (``server.lora``)."""

    def __init__(self, frontend: Frontend, security: Security) -> None:
        self.frontend = frontend
        self.adapters = frontend.adapters
        self.security = security

    def routes(self) -> list[Route]:
        return [
            Route("/v1/load_lora_adapter", self._handle(self.load), methods=["POST"]),
            Route("/v1/unload_lora_adapter", self._handle(self.unload), methods=["POST"]),
            Route("/lora-adapters", self._handle(self.list), methods=["GET"]),
            Route("/lora-adapters", self._handle(self.set_scales), methods=["POST"]),
        ]

    def _handle(self, fn: Callable[[HttpRequest], Any]) -> Callable[[HttpRequest], Any]:
        async def endpoint(request: HttpRequest) -> Response:
            try:
                return await fn(request)  # type: ignore[no-any-return]
            except Exception as exc:
                error = http_error(exc)
                return JSONResponse(
                    error_body(error.message, error.kind, error.param), error.status
                )

        return endpoint

    def _admin(self, request: HttpRequest) -> None:
        """An admin key, and a server that has admin keys at all (401 / 403)."""
        authorization = request.headers.get("authorization")
        self.security.authenticate(authorization)  # 401 for no or a wrong key
        if not self.security.admin_keys:
            raise NotAdminError(
                "loading and unloading adapters needs an admin key: start the server with "
                "--admin-api-key (or load adapters at start-up with --lora)"
            )
        self.security.authenticate_admin(authorization)

    async def _body(self, request: HttpRequest) -> Any:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise InvalidRequestError(f"the body has {len(raw)} bytes; at most {MAX_BODY_BYTES}")
        return load_body(raw)

    async def load(self, request: HttpRequest) -> Response:
        self._admin(request)
        body = await self._body(request)
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        if not self.adapters.can_load:
            raise HttpError(grpc.StatusCode.UNIMPLEMENTED, "this front holds no adapters")
        info = await self.frontend.in_thread(self.adapters.load, name, path)
        return JSONResponse(
            {
                "message": f"Success: LoRA adapter {name!r} added successfully.",
                **self._describe(info),
            }
        )

    async def unload(self, request: HttpRequest) -> Response:
        self._admin(request)
        body = await self._body(request)
        name = _field(body, "lora_name")
        info = self.adapters.unload(name)
        return JSONResponse(
            {
                "message": f"Success: LoRA adapter {name!r} removed successfully.",
                **self._describe(info),
            }
        )

    async def list(self, request: HttpRequest) -> Response:
        self.security.owner(request.headers.get("authorization"), "")  # any valid key
        return JSONResponse(self._llama_list())

    async def set_scales(self, request: HttpRequest) -> Response:
        self._admin(request)
        body = await self._body(request)
        names = self.adapters.names()
        if not isinstance(body, list):
            raise InvalidRequestError(
                f'the body must be a list of {{"id", "scale"}}, got {shown(body)}'
            )
        scales: dict[str, float] = {}
        for i, entry in enumerate(body):
            index = entry.get("id") if isinstance(entry, Mapping) else None
            scale = entry.get("scale", 1.0) if isinstance(entry, Mapping) else None
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(names):
                raise InvalidRequestError(f"[{i}].id must be an adapter's id (GET /lora-adapters)")
            if isinstance(scale, bool) or not isinstance(scale, (int, float)):
                raise InvalidRequestError(f"[{i}].scale must be a number, got {shown(scale)}")
            scales[names[index]] = float(scale)
        self.adapters.set_scales(scales)
        return JSONResponse(self._llama_list())

    def _llama_list(self) -> list[dict[str, Any]]:
        scales = self.adapters.scales()
        return [
            {"id": i, "path": info.path, "scale": scales.get(info.name, 0.0), "name": info.name}
            for i, info in enumerate(self.adapters.infos())
        ]

    def _describe(self, info: AdapterInfo) -> dict[str, Any]:
        return {
            "id": info.name,
            "object": "lora_adapter",
            "parent": self.frontend.model.name,
            "rank": info.rank,
            "alpha": info.alpha,
            "target_modules": list(info.target_modules),
            "format": info.kind,
        }


def _field(body: Any, key: str) -> str:
    value = body.get(key) if isinstance(body, Mapping) else None
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{key} must be a non-empty string, got {shown(value)}")
    return value


def model_entries(frontend: Frontend, created: int) -> list[dict[str, Any]]:
    """``/v1/models`` rows of the adapters: each with its base model as ``parent`` (vLLM's
    shape)."""
    m = frontend.model
    return [
        {
            "id": info.name,
            "object": "model",
            "created": created,
            "owned_by": "kvserve",
            "root": info.path,
            "parent": m.name,
            "max_model_len": m.max_model_len,
            "meta": {"n_vocab": m.vocab_size, "n_ctx": m.max_model_len, "lora_rank": info.rank},
        }
        for info in frontend.adapters.infos()
    ]
