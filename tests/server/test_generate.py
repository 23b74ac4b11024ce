"""Streaming generation through a real gRPC server over the FakeRunner."""

from __future__ import annotations

import asyncio

import grpc

from server.fake_tokenizer import EOS_TOKEN_ID, ByteTokenizer
from server.rpc import generation_pb2 as pb
from tests.server.helpers import collect, engine_id, expected_tokens, make_fake_runner, serve


async def test_stream_carries_exact_fake_tokens_and_final_usage() -> None:
    """Each message carries one new token; ids follow the FakeRunner rule; the last has usage."""
    async with serve() as h:
        stream = h.client.generate("hello", request_id="r1", max_tokens=6)
        msgs = await collect(stream)
    want = expected_tokens(h.runner, "r1", 6)
    assert [list(m.token_ids) for m in msgs] == [[t] for t in want]
    assert all(m.request_id == "r1" for m in msgs)
    assert [m.finished for m in msgs] == [False] * 5 + [True]
    last = msgs[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    # "hello" is 5 bytes plus BOS.
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (6, 6)
    assert last.timings.e2e_time_s >= last.timings.time_to_first_token_s > 0


async def test_text_deltas_concatenate_to_the_decoded_output() -> None:
    """The text deltas join to the tokenizer's decoding of all output tokens."""
    tok = ByteTokenizer()
    # "é" and "€" are multi-byte: the stream must never split them.
    script = list("né € ok".encode())
    runner = make_fake_runner(script={engine_id("t"): script})
    async with serve(runner) as h:
        msgs = await collect(h.client.generate("x", request_id="t", max_tokens=len(script)))
    ids = [t for m in msgs for t in m.token_ids]
    assert ids == script
    assert "".join(m.text for m in msgs) == tok.decode(script) == "né € ok"
    assert all("\ufffd" not in m.text for m in msgs)


async def test_generated_request_id_is_echoed() -> None:
    """Without a request_id the server makes one and echoes it in every message."""
    async with serve() as h:
        msgs = await collect(h.client.generate("hi", max_tokens=3))
    ids = {m.request_id for m in msgs}
    assert len(ids) == 1 and len(ids.pop()) == 32


async def test_token_id_and_chat_inputs() -> None:
    """token_ids are used as given; chat is rendered with the tokenizer's chat template."""
    async with serve() as h:
        msgs = await collect(h.client.generate([5, 6, 7], request_id="ids", max_tokens=2))
        assert msgs[-1].usage.prompt_tokens == 3
        chat = [("system", "be brief"), ("user", "hi")]
        tokenized = await h.client.tokenize(chat=chat)
        rendered = ByteTokenizer().apply_chat_template(
            [{"role": r, "content": c} for r, c in chat], add_generation_prompt=True
        )
        assert list(tokenized.token_ids) == list(rendered.encode())
        msgs = await collect(h.client.generate(chat=chat, request_id="chat", max_tokens=2))
        assert msgs[-1].usage.prompt_tokens == len(tokenized.token_ids)


async def test_64_concurrent_streams_all_complete_with_their_tokens() -> None:
    """64 streams at once: each gets exactly its own FakeRunner tokens and a LENGTH finish."""
    async with serve() as h:

        async def one(i: int) -> tuple[str, list[int], int]:
            rid = f"c{i}"
            msgs = await collect(
                h.client.generate(f"prompt {i}", request_id=rid, max_tokens=8 + i % 5)
            )
            return rid, [t for m in msgs for t in m.token_ids], msgs[-1].finish_reason

        results = await asyncio.gather(*(one(i) for i in range(64)))
        stats = await h.client.kv_cache_stats()
    for i, (rid, tokens, reason) in enumerate(results):
        assert tokens == expected_tokens(h.runner, rid, 8 + i % 5), rid
        assert reason == pb.FINISH_REASON_LENGTH
    assert stats.num_blocks_used == 0 and stats.total_sequences == 0


async def test_stop_string_ends_the_stream_before_it() -> None:
    """A stop string split over tokens ends the request with STOP; its text is not sent."""
    script = list(b"one two STOP three")
    runner = make_fake_runner(script={engine_id("s"): script})
    async with serve(runner) as h:
        msgs = await collect(h.client.generate("x", request_id="s", max_tokens=30, stop=["STOP"]))
        stats = await h.client.kv_cache_stats()
    assert "".join(m.text for m in msgs) == "one two "
    assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP
    assert msgs[-1].stop_reason == "STOP"
    # Tokens up to and including the one that completed the stop string are reported.
    assert [t for m in msgs for t in m.token_ids] == script[: len(b"one two STOP")]
    assert msgs[-1].usage.completion_tokens == len(b"one two STOP")
    assert stats.num_blocks_used == 0


async def test_eos_and_stop_token_ids_finish_with_stop() -> None:
    """EOS (not shown as text) and a stop token id both end the stream with STOP."""
    runner = make_fake_runner(
        script={engine_id("e"): [65, 66, EOS_TOKEN_ID, 67], engine_id("k"): [65, 66, 67, 68]}
    )
    async with serve(runner) as h:
        eos = await collect(h.client.generate("x", request_id="e", max_tokens=10))
        stop_id = await collect(
            h.client.generate("x", request_id="k", max_tokens=10, stop_token_ids=[67])
        )
    assert [t for m in eos for t in m.token_ids] == [65, 66, EOS_TOKEN_ID]
    assert "".join(m.text for m in eos) == "AB"
    assert eos[-1].finish_reason == pb.FINISH_REASON_STOP
    assert [t for m in stop_id for t in m.token_ids] == [65, 66, 67]
    assert stop_id[-1].finish_reason == pb.FINISH_REASON_STOP
    assert stop_id[-1].stop_reason == "67"


async def test_n_samples_stream_with_their_indexes() -> None:
    """n=3 streams samples 0..2, each with its own tokens (sample i runs as id 'r#i')."""
    async with serve() as h:
        msgs = await collect(h.client.generate("shared prompt", request_id="r", max_tokens=4, n=3))
    by_index: dict[int, list[int]] = {}
    for m in msgs:
        assert m.request_id == "r"
        by_index.setdefault(m.index, []).extend(m.token_ids)
    assert by_index == {
        0: expected_tokens(h.runner, "r", 4),
        1: expected_tokens(h.runner, "r#1", 4),
        2: expected_tokens(h.runner, "r#2", 4),
    }
    assert sorted(m.index for m in msgs if m.finished) == [0, 1, 2]


async def test_logprobs_are_streamed_when_asked() -> None:
    """logprobs=2: each token carries its logprob and two alternatives with their text."""
    async with serve() as h:
        msgs = await collect(h.client.generate("x", request_id="lp", max_tokens=3, logprobs=2))
        plain = await collect(h.client.generate("x", request_id="nolp", max_tokens=2))
    tok = ByteTokenizer()
    for m in msgs:
        (lp,) = m.logprobs
        assert lp.sampled.token_id == m.token_ids[0]
        assert lp.sampled.token == tok.id_to_token(m.token_ids[0])
        assert len(lp.top) == 2
    assert all(not m.logprobs for m in plain)


async def test_prefix_cache_hits_respect_cache_salt() -> None:
    """The same 21-token prompt reuses 5 full blocks (20 tokens) only under the same salt;
    GetKVCacheStats counts the hit tokens and accounts for every block."""
    prompt = list(range(10, 31))
    async with serve() as h:

        async def run(rid: str, salt: str) -> pb.GenerateResponse:
            msgs = await collect(
                h.client.generate(prompt, request_id=rid, max_tokens=1, cache_salt=salt)
            )
            return msgs[-1]

        first, same, other = await run("a", "t1"), await run("b", "t1"), await run("c", "t2")
        stats = await h.client.kv_cache_stats()
    assert first.usage.cached_prompt_tokens == 0
    assert same.usage.cached_prompt_tokens == 20
    assert other.usage.cached_prompt_tokens == 0
    assert stats.prefix_hits_tokens_total == 20
    assert (stats.num_blocks_used, stats.total_sequences, stats.num_blocks_total) == (0, 0, 256)
    assert (
        stats.num_blocks_used
        + stats.num_blocks_cached_free
        + stats.num_blocks_free
        + stats.num_blocks_reserved
    ) == 256
    assert stats.num_blocks_cached_free >= 10  # two salts x 5 full blocks stay cached
    assert stats.block_bytes == 2 * 2 * 2 * 8 * 4 * 4


async def test_model_info_and_tokenize() -> None:
    """GetModelInfo reports the served geometry; Tokenize returns ids and token strings."""
    async with serve() as h:
        info = await h.client.model_info()
        tokens = await h.client.tokenize("Hi", add_special_tokens=False)
    assert (info.model, info.max_context_length, info.vocab_size) == ("fake", 128, 258)
    assert (info.kv_block_size, info.kv_num_blocks) == (4, 256)
    assert list(info.eos_token_ids) == [EOS_TOKEN_ID]
    assert info.kv_memory_bytes == 256 * 2 * 2 * 2 * 8 * 4 * 4
    assert list(tokens.token_ids) == [72, 105] and list(tokens.tokens) == ["H", "i"]


async def test_duplicate_request_id_in_flight_is_rejected() -> None:
    """A second stream with the id of one in flight gets ALREADY_EXISTS; the first goes on."""
    runner = make_fake_runner(sleep_s=0.01)
    async with serve(runner) as h:
        first = h.client.generate("x", request_id="dup", max_tokens=20)
        first_msg = await anext(first)
        try:
            await collect(h.client.generate("y", request_id="dup", max_tokens=2))
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.ALREADY_EXISTS
            assert "dup" in exc.details()
        else:
            raise AssertionError("duplicate id accepted")
        rest = await collect(first)
    tokens = [t for m in [first_msg, *rest] for t in m.token_ids]
    assert tokens == expected_tokens(h.runner, "dup", 20)
