"""The OpenAI-compatible HTTP front, driven by clients we did not write: the openai SDK
(async and sync, streaming and not, error cases) and curl reading SSE."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import httpx
import openai
import pytest

from server.fake_tokenizer import ByteTokenizer
from tests.model_runner.oracle import make_runner, random_ids, tiny_hf
from tests.server.helpers import collect, expected_tokens, make_fake_runner, serve, wait_until

TOK = ByteTokenizer()


def text_of(runner: object, request_id: str, num_tokens: int) -> str:
    """What the FakeRunner generates for ``request_id``, as the byte tokenizer's text."""
    return TOK.decode(expected_tokens(runner, request_id, num_tokens), skip_special_tokens=True)  # type: ignore[arg-type]


def sdk(url: str, **kwargs: object) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, **kwargs)  # type: ignore[arg-type]


async def test_openai_sdk_async_completions_and_chat_exact_text_and_usage() -> None:
    """Non-streamed completion and chat: the FakeRunner's exact text, finish reason and
    usage; /v1/models names the served model."""
    async with serve(http=True) as h:
        client = sdk(h.http_url)
        models = await client.models.list()
        done = await client.completions.create(
            model="fake", prompt="hello", max_tokens=6, temperature=0,
            extra_headers={"X-Request-Id": "c1"},
        )  # fmt: skip
        chat = await client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_headers={"X-Request-Id": "c2"},
        )  # fmt: skip
        await client.close()
    assert [m.id for m in models.data] == ["fake"]
    assert done.id == "c1" and done.object == "text_completion"
    assert done.choices[0].text == text_of(h.runner, "c1", 6)
    assert done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (6, 6)  # BOS + 5 bytes
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == text_of(h.runner, "c2", 4)
    assert chat.usage is not None and chat.usage.completion_tokens == 4


async def test_openai_sdk_async_streaming_chat_with_usage() -> None:
    """A streamed chat opens with the assistant role, carries the text in deltas, ends with
    finish_reason and (include_usage) a final usage chunk with no choices."""
    async with serve(http=True) as h:
        client = sdk(h.http_url)
        stream = await client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            stream=True, stream_options={"include_usage": True},
            extra_headers={"X-Request-Id": "s1"},
        )  # fmt: skip
        chunks = [c async for c in stream]
        await client.close()
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == text_of(h.runner, "s1", 8)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8


async def test_openai_sdk_sync_streaming_and_not() -> None:
    """The synchronous SDK client (in a thread: the server runs in this loop) streams a
    completion from token ids and gets a whole one; n=2 gives two choices."""
    async with serve(http=True) as h:

        def run() -> tuple[str, openai.types.Completion]:
            client = openai.OpenAI(base_url=f"{h.http_url}/v1", api_key="x", max_retries=0)
            with client:
                stream = client.completions.create(
                    model="fake", prompt=[72, 105], max_tokens=5, stream=True,
                    extra_headers={"X-Request-Id": "y1"},
                )  # fmt: skip
                streamed = "".join(c.choices[0].text for c in stream if c.choices)
                whole = client.completions.create(
                    model="fake", prompt="two", max_tokens=3, n=2,
                    extra_headers={"X-Request-Id": "y2"},
                )  # fmt: skip
            return streamed, whole

        streamed, whole = await asyncio.to_thread(run)
    assert streamed == text_of(h.runner, "y1", 5)
    assert sorted(c.index for c in whole.choices) == [0, 1]
    assert whole.choices[0].text == text_of(h.runner, "y2", 3)
    assert whole.usage is not None and whole.usage.completion_tokens == 6


async def test_openai_sdk_error_cases() -> None:
    """Bad values, unsupported fields, an unknown model, a duplicate id, an overloaded queue
    and a server shutting down each raise the SDK's error for OpenAI's status, with a
    message that says what to change."""
    runner = make_fake_runner(max_model_len=1024, sleep_s=0.01)
    async with serve(runner, http=True, max_num_seqs=1, max_waiting_requests=1) as h:
        client = sdk(h.http_url)
        chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(**chat, temperature=-1)  # type: ignore[call-overload]
        with pytest.raises(openai.BadRequestError) as unsupported:
            await client.chat.completions.create(**chat, extra_body={"functions": [{"name": "f"}]})
        with pytest.raises(openai.BadRequestError) as long_:
            await client.completions.create(model="fake", prompt="x", max_tokens=5000)
        with pytest.raises(openai.NotFoundError) as unknown:
            await client.completions.create(model="gpt-4", prompt="x")
        # Runs until cancelled below (1,000 steps of 10 ms), so it holds the one seat.
        running = asyncio.create_task(
            client.completions.create(model="fake", prompt="a", max_tokens=1000,
                                      extra_headers={"X-Request-Id": "dup"})
        )  # fmt: skip
        await wait_until(lambda: h.engine.latest_stats.num_running == 1)
        with pytest.raises(openai.ConflictError) as dup:
            await client.completions.create(
                model="fake", prompt="b", extra_headers={"X-Request-Id": "dup"}
            )
        waiting = asyncio.create_task(client.completions.create(model="fake", prompt="w"))
        await wait_until(lambda: h.engine.latest_stats.num_waiting == 1)
        with pytest.raises(openai.RateLimitError) as overloaded:
            await client.completions.create(model="fake", prompt="c")
        h.server.frontend.accepting = False
        with pytest.raises(openai.InternalServerError) as closing:
            await client.completions.create(model="fake", prompt="d")
        h.server.frontend.accepting = True
        running.cancel()  # its connection closes: the request is aborted, "w" runs
        await asyncio.gather(running, return_exceptions=True)
        await waiting
        await client.close()
    assert bad.value.status_code == 400 and "temperature must be >= 0" in bad.value.message
    assert "unsupported field(s) for /v1/chat/completions: functions" in unsupported.value.message
    assert "max_tokens = 5000 is beyond the model's context of 1024" in long_.value.message
    assert "'gpt-4' does not exist: this server serves 'fake'" in unknown.value.message
    assert "request_id 'dup' is already in flight" in dup.value.message
    assert overloaded.value.status_code == 429 and "retry later" in overloaded.value.message
    assert closing.value.status_code == 503 and "shutting down" in closing.value.message


async def test_closed_http_stream_aborts_the_request_and_frees_its_blocks() -> None:
    """Leaving a streamed completion early (closing the connection) aborts the request
    (client_cancel) and its KV blocks go back."""
    runner = make_fake_runner(max_model_len=1024, sleep_s=0.01)
    async with serve(runner, http=True) as h:
        async with httpx.AsyncClient(base_url=h.http_url) as http:
            body = {"prompt": "hold blocks", "max_tokens": 500, "stream": True}
            headers = {"X-Request-Id": "gone"}
            async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                async for _line in r.aiter_lines():
                    break
        await wait_until(
            lambda: bool(h.sink.requests) and h.engine.latest_stats.kv.num_blocks_used == 0
        )
    record = h.sink.request("gone")
    assert record.abort_reason == "client_cancel" and record.num_output_tokens < 500


async def test_stream_cut_off_at_shutdown_ends_with_an_error_event() -> None:
    """A stream still running when the grace period ends gets an SSE error event (503's
    service_unavailable) instead of a normal finish, then [DONE]."""
    runner = make_fake_runner(max_model_len=1024, sleep_s=0.01)
    async with serve(runner, http=True) as h, httpx.AsyncClient(base_url=h.http_url) as http:
        body = {"prompt": "x", "max_tokens": 500, "stream": True}
        headers = {"X-Request-Id": "cut"}
        lines = []
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            async for line in r.aiter_lines():
                lines.append(line)
                if len(lines) == 1:
                    shutdown = asyncio.create_task(h.server.shutdown(grace_s=0.1))
        await shutdown
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
    assert events[-1]["error"]["type"] == "service_unavailable"
    assert "'cut' was cut off: the server shut down" in events[-1]["error"]["message"]
    assert all("error" not in e for e in events[:-1])


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
async def test_curl_reads_the_sse_stream() -> None:
    """Plain curl (-N, no buffering) gets text/event-stream chunks whose text is the exact
    output, then data: [DONE]."""
    async with serve(http=True) as h:
        body = json.dumps({"model": "fake", "prompt": "hi", "max_tokens": 6, "stream": True})
        proc = await asyncio.create_subprocess_exec(
            "curl", "-sN", "-i", f"{h.http_url}/v1/completions",
            "-H", "Content-Type: application/json", "-H", "X-Request-Id: curl1", "-d", body,
            stdout=subprocess.PIPE,
        )  # fmt: skip
        out, _ = await proc.communicate()
    head, _, payload = out.decode().partition("\r\n\r\n")
    assert "content-type: text/event-stream" in head.lower()
    data = [line[6:] for line in payload.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    text = "".join(c["text"] for c in map(json.loads, data[:-1]) for c in c["choices"])
    assert text == text_of(h.runner, "curl1", 6)


@pytest.mark.slow
async def test_http_and_grpc_give_the_same_greedy_tokens_on_a_tiny_model() -> None:
    """The same greedy request (token-id prompt, 12 tokens, ignore_eos) over HTTP and over
    gRPC gives the same tokens, and both equal transformers' generate()."""
    from tests.server.test_torch_model import hf_greedy

    hf = tiny_hf("llama-gqa", seed=3)
    runner = make_runner(hf, num_blocks=64, block_size=4)
    prompts = [random_ids(7, seed=61), random_ids(19, seed=62)]
    want = [hf_greedy(hf, p) for p in prompts]  # MAX_TOKENS = 10 there
    async with serve(
        runner, ByteTokenizer(), http=True, max_num_seqs=8, max_num_batched_tokens=16
    ) as h:
        grpc_ids = [
            [t for m in await collect(h.client.generate(p, max_tokens=10, temperature=0.0,
                                                        ignore_eos=True)) for t in m.token_ids]
            for p in prompts
        ]  # fmt: skip
        client = sdk(h.http_url)
        http_texts = []
        for p in prompts:
            done = await client.completions.create(
                model=h.server.model.name, prompt=p, max_tokens=10, temperature=0,
                extra_body={"ignore_eos": True}, logprobs=0,
            )  # fmt: skip
            http_texts.append(done.choices[0])
        await client.close()
    for i, choice in enumerate(http_texts):
        assert grpc_ids[i] == want[i], f"prompt {i}"
        # The tiny vocabulary is 128 ids: the byte tokenizer's one-byte tokens, so the text
        # and the logprob tokens spell the ids one for one.
        assert choice.text == TOK.decode(want[i], skip_special_tokens=True)
        assert choice.logprobs is not None
        assert choice.logprobs.tokens == [TOK.id_to_token(t) for t in want[i]]
        assert choice.finish_reason == "length"


@pytest.mark.slow
async def test_openai_sdk_streams_paris_from_the_embedded_model() -> None:
    """`kvserve serve`'s defaults (the embedded SmolLM2, quantized weights): the openai SDK
    streams a greedy chat answer to "What is the capital of France?" that names Paris."""
    from server.build import build_engine
    from server.config import build_config
    from server.lifecycle import KVServeServer

    built = await asyncio.to_thread(build_engine, build_config({"threads": 2}, environ={}))
    server = KVServeServer(built.engine, built.tokenizer, built.model)
    await server.start("127.0.0.1", 0, http_port=0)
    try:
        client = sdk(f"http://127.0.0.1:{server.http_port}")
        stream = await client.chat.completions.create(
            model=built.model.name,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=32, temperature=0, stream=True,
        )  # fmt: skip
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await client.close()
    finally:
        await server.shutdown(grace_s=1)
    assert "Paris" in text, text


async def test_a_client_that_hangs_up_on_a_whole_answer_aborts_it() -> None:
    """A non-streamed completion whose client times out and closes the connection is
    aborted (client_cancel) at once, not run to its end."""
    runner = make_fake_runner(max_model_len=1024, sleep_s=0.01)
    async with serve(runner, http=True) as h:
        async with httpx.AsyncClient(base_url=h.http_url, timeout=0.3) as http:
            body = {"prompt": "long", "max_tokens": 500}
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/v1/completions", json=body, headers={"X-Request-Id": "hup"})
        await wait_until(
            lambda: bool(h.sink.requests) and h.engine.latest_stats.kv.num_blocks_used == 0
        )
    record = h.sink.request("hup")
    assert record.abort_reason == "client_cancel" and record.num_output_tokens < 500
