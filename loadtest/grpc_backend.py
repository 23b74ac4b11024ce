"""The load generator's gRPC backend: kvserve's ``kvserve.v1.Generation`` service."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator

import grpc

from loadtest import server_stats
from loadtest.backend import RequestFailed, StreamEvent
from loadtest.workload import RequestSpec
from server.client import NoServerError
from server.rpc import generation_pb2 as pb
from server.rpc import generation_pb2_grpc as pb_grpc

_FAILED_FINISH = {
    pb.FINISH_REASON_ERROR: "FINISH_REASON_ERROR",
    pb.FINISH_REASON_ABORT: "FINISH_REASON_ABORT",
}


def build_request(
    spec: RequestSpec, request_id: str, cache_salt: str | None = None
) -> pb.GenerateRequest:
    sampling = pb.SamplingOptions(**{k: v for k, v in spec.sampling.items()})
    stopping = pb.StoppingOptions(max_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos)
    req = pb.GenerateRequest(
        sampling=sampling,
        stopping=stopping,
        request_id=request_id,
        priority=spec.priority,
        cache_salt=cache_salt or "",
        adapter=spec.adapter or "",
    )
    for kind, value in (spec.constraint or {}).items():
        if kind == "choice":
            req.choice.choices.extend(value)
        else:
            setattr(req, kind, value if isinstance(value, str) else json.dumps(value))
    if spec.prompt_token_ids is not None:
        req.token_ids.ids.extend(spec.prompt_token_ids)
    else:
        assert spec.prompt_text is not None
        req.text = spec.prompt_text
    return req


class GrpcBackend:
    """``Generate`` streams over one channel; ``GetModelInfo`` and ``GetKVCacheStats``."""

    api = "grpc"

    def __init__(self, target: str) -> None:
        self.target = target
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.GenerationStub | None = None

    @property
    def stub(self) -> pb_grpc.GenerationStub:
        assert self._stub is not None, "open() first"
        return self._stub

    async def open(self, wait_s: float) -> None:
        self._channel = grpc.aio.insecure_channel(
            self.target, options=[("grpc.max_receive_message_length", 64 << 20)]
        )
        self._stub = pb_grpc.GenerationStub(self._channel)
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout=wait_s)
        except TimeoutError:
            await self.close()
            raise NoServerError(self.target) from None

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def vocab_size(self) -> int | None:
        info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10.0)
        return int(info.vocab_size)

    async def generate(
        self,
        spec: RequestSpec,
        request_id: str,
        timeout_s: float | None,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[StreamEvent, None]:
        call = self.stub.Generate(build_request(spec, request_id, cache_salt), timeout=timeout_s)
        finished = False
        try:
            async for msg in call:
                if not msg.finished:
                    yield StreamEvent(num_tokens=len(msg.token_ids))
                    continue
                finished = True
                usage = msg.usage if msg.HasField("usage") else None
                yield StreamEvent(
                    num_tokens=len(msg.token_ids),
                    finish_reason=pb.FinishReason.Name(msg.finish_reason),
                    failed=msg.finish_reason in _FAILED_FINISH,
                    num_prompt_tokens=usage.prompt_tokens or None if usage else None,
                    num_cached_tokens=usage.cached_prompt_tokens if usage else None,
                )
                return
        except grpc.aio.AioRpcError as e:
            raise RequestFailed(e.code().name, e.details() or "") from None
        finally:
            if not finished:  # closed early (a cancel, the time bound): abort on the server
                call.cancel()

    async def read_server(self) -> server_stats.Samples | None:
        try:
            reply = await self.stub.GetKVCacheStats(pb.GetKVCacheStatsRequest(), timeout=5.0)
        except grpc.aio.AioRpcError:
            return None
        return server_stats.kv_stats_samples(reply)
