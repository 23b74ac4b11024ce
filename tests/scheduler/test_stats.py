"""make_stats(): exact snapshot fields after a scripted sequence of steps."""

from __future__ import annotations

from tests.scheduler.helpers import make_request, make_runner, make_scheduler, step


def test_stats_track_batches_counters_and_the_kv_snapshot() -> None:
    """Two seats, budget 8: r0 (6 tokens) and r1's first 2 tokens prefill in step 1, r2 waits
    for a seat until step 4. Every field of the snapshot is pinned along the way."""
    sched, kv = make_scheduler(num_blocks=8, max_num_seqs=2, max_num_batched_tokens=8)
    runner = make_runner(kv)
    sched.add_request(make_request("r0", prompt_len=6, max_tokens=3))
    sched.add_request(make_request("r1", prompt_len=5, max_tokens=2, first_token=200))
    sched.add_request(make_request("r2", prompt_len=3, max_tokens=2, first_token=300))

    step(sched, runner)
    s = sched.make_stats()
    assert (s.step_id, s.num_running, s.num_waiting, s.num_preempted) == (1, 2, 1, 0)
    assert (s.num_prefill_tokens, s.num_prefill_reqs, s.num_decode_reqs) == (8, 2, 0)
    assert (s.num_steps_prefill_total, s.num_steps_decode_total) == (1, 0)
    assert (s.num_prompt_tokens_total, s.num_generation_tokens_total) == (14, 1)
    assert (s.num_waiting_tokens, s.num_finished_total) == (3, {})
    assert (s.kv.num_blocks_used, s.kv.num_blocks_free, s.kv.total_sequences) == (3, 5, 2)
    assert s.num_preemptions_total == 0

    step(sched, runner)
    s = sched.make_stats()
    assert (s.num_prefill_tokens, s.num_prefill_reqs, s.num_decode_reqs) == (3, 1, 1)
    assert (s.num_steps_prefill_total, s.num_steps_decode_total) == (2, 1)
    assert s.num_generation_tokens_total == 3

    step(sched, runner)  # r0 and r1 decode and both finish; r2 found no seat at planning
    s = sched.make_stats()
    assert (s.num_running, s.num_waiting, s.num_finished_total) == (0, 1, {"length": 2})
    assert (s.num_prefill_tokens, s.num_decode_reqs) == (0, 2)

    step(sched, runner)
    step(sched, runner)
    s = sched.make_stats()
    assert (s.num_steps_prefill_total, s.num_steps_decode_total) == (3, 3)
    assert (s.num_generation_tokens_total, s.num_finished_total) == (7, {"length": 3})
    assert (s.num_running, s.num_waiting, s.num_waiting_tokens) == (0, 0, 0)
    assert (s.kv.num_blocks_used, s.kv.total_sequences) == (0, 0)
