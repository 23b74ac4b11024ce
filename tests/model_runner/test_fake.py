"""FakeRunner: the documented token rule, scripts, failure injection, the shadow-KV check."""

from __future__ import annotations

import hashlib

import pytest

from model_runner.fake import FakeRunner, FakeRunnerCrash, make_fake_info
from scheduler import SamplingParams, ScheduledSeq, SchedulerOutput, TokenLogprobs


def _seq(
    rid: str,
    all_ids: list[int],
    start: int,
    num: int,
    block_ids: list[int],
    num_prompt: int | None = None,
    logprobs: int | None = None,
) -> ScheduledSeq:
    num_prompt = len(all_ids) if num_prompt is None else num_prompt
    return ScheduledSeq(
        request_id=rid,
        token_ids=all_ids[start : start + num],
        start_pos=start,
        block_ids=block_ids,
        sampling=SamplingParams(logprobs=logprobs),
        do_sample=start + num == len(all_ids),
        all_token_ids=all_ids,
        num_prompt_tokens=num_prompt,
        num_output_tokens=len(all_ids) - num_prompt,
    )


def _reference_token(seed: int, key: str, index: int, vocab: int, eos: set[int]) -> int:
    digest = hashlib.blake2b(f"{seed}:{key}:{index}".encode(), digest_size=8).digest()
    token = int.from_bytes(digest, "big") % vocab
    while token in eos:
        token = (token + 1) % vocab
    return token


def test_default_tokens_follow_the_documented_rule() -> None:
    """Token i of a request = blake2b(f"{seed}:{request_id}:{i}") mod vocab, skipping EOS."""
    runner = FakeRunner(make_fake_info(vocab_size=1000, eos_token_ids=(2,)), seed=7)
    for i in range(20):
        assert runner.default_token("r0", i) == _reference_token(7, "r0", i, 1000, {2})
    prompt = [5, 6, 7]
    out = runner.execute(SchedulerOutput(step_id=1, prefill=[_seq("r0", prompt, 0, 3, [0])]))
    assert out.sampled_token_ids == {"r0": _reference_token(7, "r0", 0, 1000, {2})}


def test_default_tokens_never_hit_eos() -> None:
    """With every id but 3 being EOS, every default token is 3."""
    runner = FakeRunner(make_fake_info(vocab_size=4, eos_token_ids=(0, 1, 2)))
    assert {runner.default_token("r", i) for i in range(50)} == {3}


def test_key_by_prompt_gives_equal_prompts_equal_continuations() -> None:
    """key_by='prompt': two ids with one prompt get the same tokens, another prompt others."""
    runner = FakeRunner(make_fake_info(vocab_size=50_000), key_by="prompt")
    a = runner.execute(
        SchedulerOutput(step_id=1, prefill=[_seq("a", [1, 2, 3], 0, 3, [0])])
    ).sampled_token_ids["a"]
    b = runner.execute(
        SchedulerOutput(step_id=2, prefill=[_seq("b", [1, 2, 3], 0, 3, [1])])
    ).sampled_token_ids["b"]
    assert a == b == runner.default_token("1,2,3", 0)
    c = runner.execute(
        SchedulerOutput(step_id=3, prefill=[_seq("c", [1, 2, 4], 0, 3, [2])])
    ).sampled_token_ids["c"]
    assert c == runner.default_token("1,2,4", 0)


def test_script_wins_then_falls_back_to_the_default_rule() -> None:
    """Scripted ids give the scripted tokens by output index, then the default rule."""
    runner = FakeRunner(script={"r0": [11, 12]})
    ids = [1, 2]
    tokens = []
    for _ in range(3):
        start = len(ids) - 1 if len(ids) > 2 else 0
        seq = _seq("r0", ids, start, len(ids) - start, [0], num_prompt=2)
        token = runner.execute(SchedulerOutput(step_id=1, prefill=[seq])).sampled_token_ids["r0"]
        tokens.append(token)
        ids = [*ids, token]
    assert tokens == [11, 12, runner.default_token("r0", 2)]


def test_middle_chunk_samples_nothing() -> None:
    """A seq with do_sample=False produces no token."""
    runner = FakeRunner()
    out = runner.execute(SchedulerOutput(step_id=1, prefill=[_seq("r0", [1, 2, 3, 4], 0, 2, [0])]))
    assert out.sampled_token_ids == {} and out.failed == {}


def test_fail_request_fails_it_once() -> None:
    """fail_request puts the request into ModelOutput.failed at its next step, only then."""
    runner = FakeRunner()
    runner.fail_request("r1", "boom")
    plan = SchedulerOutput(
        step_id=1, prefill=[_seq("r0", [1, 2], 0, 2, [0]), _seq("r1", [3, 4], 0, 2, [1])]
    )
    out = runner.execute(plan)
    assert out.failed == {"r1": "boom"} and list(out.sampled_token_ids) == ["r0"]
    assert runner.execute(plan).failed == {}


def test_crash_emulates_runner_death() -> None:
    """crash_next_step raises once (default FakeRunnerCrash); crash_at_step from that step id
    on (a dead device)."""
    runner = FakeRunner(crash_at_step=3)
    runner.crash_next_step()
    with pytest.raises(FakeRunnerCrash):
        runner.execute(SchedulerOutput(step_id=1))
    runner.execute(SchedulerOutput(step_id=2))
    with pytest.raises(FakeRunnerCrash, match="step 3"):
        runner.execute(SchedulerOutput(step_id=3))
    with pytest.raises(FakeRunnerCrash, match=r"step 3 \(step 4\)"):
        runner.execute(SchedulerOutput(step_id=4))
    runner = FakeRunner()
    runner.crash_next_step(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        runner.execute(SchedulerOutput(step_id=4))


def test_logprobs_rank_the_sampled_token_first() -> None:
    """logprobs=2: the sampled token at 0.0, then its vocab neighbour at -0.5."""
    runner = FakeRunner(make_fake_info(vocab_size=100), script={"r0": [99]})
    plan = SchedulerOutput(step_id=1, prefill=[_seq("r0", [1, 2], 0, 2, [0], logprobs=2)])
    out = runner.execute(plan)
    assert out.logprobs == {"r0": TokenLogprobs(99, 0.0, ((99, 0.0), (0, -0.5)))}


def test_sleep_emulates_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """sleep_s + sleep_per_token_s * scheduled tokens is slept once per step."""
    slept: list[float] = []
    monkeypatch.setattr("model_runner.fake.time.sleep", slept.append)
    runner = FakeRunner(sleep_s=0.5, sleep_per_token_s=0.25)
    runner.execute(SchedulerOutput(step_id=1, prefill=[_seq("r0", [1, 2, 3], 0, 3, [0])]))
    runner.execute(SchedulerOutput(step_id=2))
    assert slept == [0.5 + 0.25 * 3, 0.5]


def test_shadow_kv_accepts_a_consistent_plan_and_applies_copies() -> None:
    """Prefill into [0, 1], copy block 1 to 2, decode on [0, 2]: the copied slots check out."""
    runner = FakeRunner(verify_kv_block_size=2, record_plans=True)
    ids = [10, 11, 12]
    runner.execute(SchedulerOutput(step_id=1, prefill=[_seq("r0", ids, 0, 3, [0, 1])]))
    plan = SchedulerOutput(
        step_id=2,
        decode=[_seq("r1", [10, 11, 12, 13], 3, 1, [0, 2], num_prompt=3)],
        block_copies=[(1, 2)],
    )
    runner.execute(plan)
    assert runner.plans is not None and [p.step_id for p in runner.plans] == [1, 2]


@pytest.mark.parametrize(
    ("seq", "copies", "message"),
    [
        (_seq("r1", [10, 11, 99, 13], 3, 1, [0, 1], num_prompt=3), [], "position 2 in block 1"),
        (_seq("r1", [10, 11, 12, 13], 3, 1, [0, 2], num_prompt=3), [], "position 2 in block 2"),
        (_seq("r1", [10, 11, 12, 13], 3, 1, [0], num_prompt=3), [], "cannot hold"),
        (_seq("r1", [10, 11, 12, 13], 3, 1, [0, 3], num_prompt=3), [(2, 3)], "holds None"),
    ],
)
def test_shadow_kv_rejects_inconsistent_plans(
    seq: ScheduledSeq, copies: list[tuple[int, int]], message: str
) -> None:
    """Wrong tokens in a block, a missing copy, a short table, a copy of nothing: caught."""
    runner = FakeRunner(verify_kv_block_size=2)
    runner.execute(SchedulerOutput(step_id=1, prefill=[_seq("r0", [10, 11, 12], 0, 3, [0, 1])]))
    with pytest.raises(AssertionError, match=message):
        runner.execute(SchedulerOutput(step_id=2, decode=[seq], block_copies=copies))


def test_shadow_kv_checks_do_sample_and_token_ids() -> None:
    """token_ids must equal all_token_ids[start:end]; do_sample must mark the last chunk."""
    runner = FakeRunner(verify_kv_block_size=4)
    bad = _seq("r0", [1, 2, 3], 0, 3, [0])
    bad.token_ids = [1, 2, 4]
    with pytest.raises(AssertionError, match="token_ids"):
        runner.execute(SchedulerOutput(step_id=1, prefill=[bad]))
    early = _seq("r0", [1, 2, 3], 0, 2, [0])
    early.do_sample = True
    with pytest.raises(AssertionError, match="do_sample=True"):
        runner.execute(SchedulerOutput(step_id=2, prefill=[early]))


def test_invalid_arguments_are_refused() -> None:
    """Bad key_by, negative sleeps, a vocabulary of only EOS: ValueError."""
    with pytest.raises(ValueError, match="key_by"):
        FakeRunner(key_by="nope")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sleep"):
        FakeRunner(sleep_s=-1)
    with pytest.raises(ValueError, match="no non-EOS token"):
        FakeRunner(make_fake_info(vocab_size=2, eos_token_ids=(0, 1)))
