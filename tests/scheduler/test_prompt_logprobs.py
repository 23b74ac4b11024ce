"""Prompt logprobs in the plan and in the outputs: which rows each chunk scores, no prefix hit
while a prompt is scored, the scores on the first output only, and a prefill preempted
half-way scored again from the start without repeats (FakeRunner scores each prompt token
as its own top one)."""

from __future__ import annotations

from tests.scheduler.helpers import (
    make_request,
    make_runner,
    make_scheduler,
    run_until_done,
    step,
)


def test_each_chunk_scores_its_rows_and_the_first_output_carries_them() -> None:
    """A 10-token prompt in 8-token steps after another request cached its blocks: no hit,
    chunks score 8 then 1 rows (the last prompt token scores nothing: the sampled token
    follows it), decodes score none; the first output holds tokens 1..9 with their top 2,
    later outputs none; a request without prompt logprobs then hits the cache."""
    sched, kv = make_scheduler(num_blocks=16, enable_prefix_caching=True)
    runner = make_runner(kv)
    sched.add_request(make_request("warm", prompt_len=10, max_tokens=1))
    run_until_done(sched, runner)
    sched.add_request(make_request("s", prompt_len=10, max_tokens=3, prompt_logprobs=2))
    steps = run_until_done(sched, runner)
    chunks = [(q.start_pos, q.num_tokens, q.num_prompt_logprobs) for st in steps
              for q in st.plan.prefill]  # fmt: skip
    assert chunks == [(0, 8, 8), (8, 2, 1)]
    assert all(q.num_prompt_logprobs == 0 for st in steps for q in st.plan.decode)
    outs = [o for st in steps for o in st.outputs]
    assert outs[0].num_cached_tokens == 0
    scored = outs[0].prompt_logprobs
    assert scored is not None
    prompt = list(range(100, 110))
    assert [s.token_id for s in scored] == prompt[1:]
    assert [[t for t, _ in s.top] for s in scored] == [[t, t + 1] for t in prompt[1:]]
    assert all(o.prompt_logprobs is None for o in outs[1:])
    sched.add_request(make_request("later", prompt_len=10, max_tokens=1))
    (done,) = [o for st in run_until_done(sched, runner) for o in st.outputs]
    assert done.num_cached_tokens == 8


def test_a_prefill_preempted_half_way_is_scored_again_without_repeats() -> None:
    """A scored prompt preempted after its first chunk (a more urgent request takes its only
    seat) resumes from position 0, not from its cached blocks, and its first output holds
    each prompt token once."""
    sched, kv = make_scheduler(
        num_blocks=16, enable_prefix_caching=True, max_num_seqs=1, queue_order="priority",
        max_num_batched_tokens=8, long_prefill_token_threshold=4,
    )  # fmt: skip
    runner = make_runner(kv)
    sched.add_request(make_request("s", prompt_len=12, max_tokens=2, priority=5, prompt_logprobs=0))
    first = step(sched, runner)
    assert [(q.start_pos, q.num_prompt_logprobs) for q in first.plan.prefill] == [(0, 4)]
    sched.add_request(make_request("urgent", prompt_len=3, max_tokens=1, first_token=300))
    steps = run_until_done(sched, runner)
    s_chunks = [(q.start_pos, q.num_prompt_logprobs) for st in steps for q in st.plan.prefill
                if q.request_id == "s"]  # fmt: skip
    assert s_chunks == [(0, 4), (4, 4), (8, 3)]
    assert sched.make_stats().num_preemptions_total == 1
    (out,) = [o for st in steps for o in st.outputs if o.request_id == "s" and o.prompt_logprobs]
    assert out.prompt_logprobs is not None
    assert [s.token_id for s in out.prompt_logprobs] == list(range(101, 112))
    assert out.num_cached_tokens == 0
