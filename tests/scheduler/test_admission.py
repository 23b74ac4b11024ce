"""Admission control: ValueError for requests that can never run, OverloadError over bounds."""

from __future__ import annotations

import pytest

from scheduler import OverloadError, Request, SamplingParams
from tests.scheduler.helpers import (
    assert_no_blocks_held,
    make_request,
    make_runner,
    make_scheduler,
    step,
)


def test_prompt_plus_max_tokens_beyond_max_model_len_is_rejected_with_numbers() -> None:
    """10 + 8 tokens > max_model_len 16: ValueError naming every number; nothing queued."""
    sched, _ = make_scheduler(max_model_len=16)
    with pytest.raises(
        ValueError,
        match=r"prompt \(10 tokens\) \+ max_tokens \(8\) = 18 tokens exceeds max_model_len \(16\)",
    ):
        sched.add_request(make_request("r0", prompt_len=10, max_tokens=8))
    assert sched.num_waiting == 0 and sched.get_request("r0") is None
    sched.add_request(make_request("r0", prompt_len=10, max_tokens=6))  # 16 fits exactly


def test_request_beyond_the_whole_kv_pool_is_rejected_with_numbers() -> None:
    """18 tokens need 5 blocks of 4 but the pool has 4: ValueError, not an endless wait."""
    sched, _ = make_scheduler(num_blocks=4)
    with pytest.raises(ValueError, match=r"need 5 KV blocks of 4 tokens, but the whole pool has 4"):
        sched.add_request(make_request("r0", prompt_len=10, max_tokens=8))
    sched.add_request(make_request("r1", prompt_len=10, max_tokens=6))


def test_sliding_window_bounds_the_blocks_a_request_needs() -> None:
    """With a window of 8 tokens, a 64-token request (16 blocks of 4) runs in a pool of 8:
    it is admitted, never holds more than the window's 2 blocks plus the one being written,
    and produces all 60 tokens with no block held at the end."""
    sched, kv = make_scheduler(num_blocks=8, sliding_window=8)
    runner = make_runner(kv)
    sched.add_request(make_request("r0", prompt_len=4, max_tokens=60))
    tokens: list[int] = []
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        s = step(sched, runner)
        assert kv.make_stats().num_blocks_used <= 8 // 4 + 1
        tokens += [t for out in s.outputs for t in out.new_token_ids]
    assert tokens == [runner.default_token("r0", i) for i in range(60)]
    assert_no_blocks_held(kv)


def test_malformed_requests_are_rejected() -> None:
    """Empty prompt, duplicate id, a request that already ran: ValueError each."""
    sched, _ = make_scheduler()
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request(Request("e", prompt_token_ids=[]))
    sched.add_request(make_request("r0"))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("r0"))
    used = make_request("r1")
    used.num_computed_tokens = 3
    with pytest.raises(ValueError, match="must be new"):
        sched.add_request(used)
    assert sched.num_waiting == 1


def test_waiting_request_bound_raises_overload() -> None:
    """Over max_waiting_requests, add_request raises OverloadError and changes nothing."""
    sched, kv = make_scheduler(max_waiting_requests=2, max_num_seqs=1)
    sched.add_request(make_request("r0", prompt_len=3))
    sched.add_request(make_request("r1", prompt_len=3))
    with pytest.raises(OverloadError, match=r"2 requests waiting \(max_waiting_requests=2\)"):
        sched.add_request(make_request("r2", prompt_len=3))
    assert sched.num_waiting == 2 and sched.get_request("r2") is None
    step(sched, make_runner(kv))  # r0 is admitted: room for one more
    sched.add_request(make_request("r2", prompt_len=3))
    assert sched.num_waiting == 2


def test_waiting_token_bound_raises_overload() -> None:
    """Over max_waiting_tokens (prompt tokens still to compute), OverloadError with numbers."""
    sched, _ = make_scheduler(max_waiting_tokens=15)
    sched.add_request(make_request("r0", prompt_len=10))
    with pytest.raises(
        OverloadError, match=r"10 prompt tokens waiting \+ 6 new > max_waiting_tokens=15"
    ):
        sched.add_request(make_request("r1", prompt_len=6))
    sched.add_request(make_request("r1", prompt_len=5))
    assert sched.make_stats().num_waiting_tokens == 15


def _tenant_request(rid: str, tenant: str, prompt_len: int = 3) -> Request:
    request = make_request(rid, prompt_len=prompt_len)
    request.tenant = tenant
    return request


def test_a_tenants_flood_is_refused_while_other_tenants_are_admitted() -> None:
    """Per tenant at most 2 requests and 10 prompt tokens wait (8 overall): alice's third
    request and then her 11th token are refused with her numbers, while bob's and an
    untenanted request are admitted; once one of hers runs, she has room again, and when
    all have left the queue her counts are gone."""
    sched, kv = make_scheduler(
        max_waiting_requests=8,
        max_waiting_requests_per_tenant=2,
        max_waiting_tokens_per_tenant=10,
        max_num_seqs=1,
    )
    sched.add_request(_tenant_request("a0", "alice"))
    sched.add_request(_tenant_request("a1", "alice"))
    with pytest.raises(
        OverloadError, match=r"2 of its requests waiting \(max_waiting_requests_per_tenant=2\)"
    ):
        sched.add_request(_tenant_request("a2", "alice"))
    sched.add_request(_tenant_request("b0", "bob"))
    sched.add_request(_tenant_request("b1", "bob", prompt_len=7))
    sched.add_request(make_request("anyone", prompt_len=3))
    assert sched.num_waiting == 5
    step(sched, make_runner(kv))  # a0 is admitted: alice has one waiting, 3 tokens
    with pytest.raises(
        OverloadError,
        match=r"3 of its prompt tokens waiting \+ 8 new > max_waiting_tokens_per_tenant=10",
    ):
        sched.add_request(_tenant_request("a2", "alice", prompt_len=8))
    sched.add_request(_tenant_request("a2", "alice", prompt_len=7))
    assert sched._waiting.tenant_counts("alice") == (2, 10)
    assert sched._waiting.tenant_counts("bob") == (2, 10)
    for rid in ("a0", "a1", "a2", "b0", "b1", "anyone"):
        sched.abort(rid)
    assert sched._waiting.tenant_counts("alice") == (0, 0) and not sched._waiting._tenants


def test_invalid_request_is_a_value_error_even_when_overloaded() -> None:
    """A request that can never run gets ValueError (INVALID_ARGUMENT), not OverloadError."""
    sched, _ = make_scheduler(max_waiting_requests=0, max_model_len=16)
    with pytest.raises(ValueError):
        sched.add_request(make_request("r0", prompt_len=10, max_tokens=8))
    with pytest.raises(OverloadError):
        sched.add_request(make_request("r0", prompt_len=4, max_tokens=4))


def test_n_samples_are_checked_at_admission() -> None:
    """n beyond max_num_seqs, or n > 1 in reserve mode, can never run."""
    sched, _ = make_scheduler(max_num_seqs=2)
    with pytest.raises(ValueError, match=r"n=3 samples exceed max_num_seqs \(2\)"):
        sched.add_request(make_request("r0", n=3))
    reserve, _ = make_scheduler(memory_mode="reserve")
    with pytest.raises(ValueError, match="reserve memory mode"):
        reserve.add_request(make_request("r0", n=2))
    # The ids of the forked samples ("<id>#<i>") are reserved at admission, both ways.
    sched.add_request(Request("r1", [5, 6, 7], SamplingParams(n=2, max_tokens=2)))
    with pytest.raises(ValueError, match=r"request id 'r1#1' is already in use"):
        sched.add_request(Request("r1#1", [5], SamplingParams(max_tokens=2)))
    sched.add_request(Request("r2#1", [5], SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match=r"the id of its sample 'r2#1' is in use"):
        sched.add_request(Request("r2", [5, 6, 7], SamplingParams(n=2, max_tokens=2)))
