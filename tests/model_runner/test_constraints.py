"""Structured outputs in the step, on the fake runner and on a tiny real model: every token a
constrained request gets lies in the mask a fresh replay of its earlier tokens gives, and after
every step each tracked matcher equals that replay, through n > 1, preemption, speculative
drafts (rolled back when rejected) and aborts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from cache_manager import KVCacheConfig, KVCacheManager
from model_runner.constraints import (
    ConstraintCompiler,
    ConstraintError,
    ConstraintTracker,
    allowed_token_ids,
    is_allowed,
)
from model_runner.fake import FakeRunner, make_fake_info
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.output import ScheduledSeq
from scheduler.request import Constraint, FinishReason, SamplingParamsError
from server.fake_tokenizer import EOS_TOKEN_ID, ByteTokenizer

REGEX = Constraint("regex", r"(ab|cd)+x")
SCHEMA = Constraint(
    "json_schema",
    '{"type": "object", "properties": {"k": {"enum": ["yes", "no"]}, '
    '"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["k", "n"], '
    '"additionalProperties": false}',
)
CHOICE = Constraint("choice", '["red", "green", "blue"]')


class TinyTokenizer:
    """The tiny test models' 128 ids: 0-2 special (2 = EOS), 3-127 their ASCII byte."""

    vocab_size = 128
    eos_token_ids = (2,)
    bos_token_id = 1
    special_token_ids = frozenset({0, 1, 2})

    def token_bytes(self, token_id: int) -> bytes:
        return b"<s%d>" % token_id if token_id < 3 else bytes([token_id])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b for b in text.encode() if b >= 3]


def byte_compiler() -> ConstraintCompiler:
    return ConstraintCompiler(ByteTokenizer())


def run(
    runner: Any,
    tracker: ConstraintTracker,
    requests: Sequence[Request],
    *,
    num_blocks: int = 64,
    abort_after: dict[str, int] | None = None,
    **config: Any,
) -> tuple[dict[str, list[int]], dict[str, FinishReason | None], Scheduler]:
    """Run ``requests`` (all added at once) to the end. After every step: each new token of a
    constrained sample is allowed by ``replay_mask`` of the tokens before it, and every
    tracked matcher has consumed exactly its sample's output and has the replay's mask.
    ``abort_after``: abort that request once it has this many output tokens."""
    compiler = tracker.compiler
    kv = KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=4))
    config.setdefault("max_num_seqs", 4)
    config.setdefault("max_num_batched_tokens", 16)
    config.setdefault("max_model_len", 128)
    scheduler = Scheduler(SchedulerConfig(**config), kv)
    constraints = {r.request_id: r.sampling.constraint for r in requests}
    for r in requests:
        scheduler.add_request(r)
    outputs: dict[str, list[int]] = {}
    finish: dict[str, FinishReason | None] = {}
    abort_after = dict(abort_after or {})
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        plan = scheduler.schedule()
        result = runner.execute(plan)
        assert not result.failed, result.failed
        for out in scheduler.update(plan, result):
            rid = out.request_id
            constraint = constraints[out.parent_id or rid]
            before = outputs.setdefault(rid, [])
            for token in out.new_token_ids:
                if constraint is not None:
                    assert is_allowed(compiler.replay_mask(constraint, before), token), (
                        rid,
                        before,
                    )
                before.append(token)
            if out.finished:
                finish[rid] = out.finish_reason
            elif len(before) >= abort_after.get(rid, 1 << 30):
                del abort_after[rid]
                assert scheduler.abort(rid) is not None
                finish[rid] = FinishReason.ABORT
        kv.check_invariants()
        for rid, out_ids in outputs.items():
            req = scheduler.get_request(rid)
            if req is None or req.is_finished or tracker.token_ids(rid) is None:
                continue
            assert tracker.token_ids(rid) == out_ids == req.output_token_ids
            constraint = req.sampling.constraint
            assert constraint is not None
            # The tracked matcher's mask now (it is level: computing it changes no state).
            now = ScheduledSeq(
                rid, [0], 0, [], req.sampling, True,
                all_token_ids=[*req.prompt_token_ids, *out_ids],
                num_prompt_tokens=len(req.prompt_token_ids),
            )  # fmt: skip
            masks = tracker.compute_masks([now])
            assert masks.bitmask is not None and not masks.failed
            assert (masks.bitmask[0] == compiler.replay_mask(constraint, out_ids)).all()
    else:
        raise AssertionError("the run did not finish")
    runner.execute(scheduler.schedule())  # the last finished ids reach the runner
    return outputs, finish, scheduler


def fake_runner(tracker: ConstraintTracker, **kwargs: Any) -> FakeRunner:
    info = make_fake_info(vocab_size=258, eos_token_ids=(EOS_TOKEN_ID,), bos_token_id=256)
    return FakeRunner(info, constraints=tracker, verify_kv_block_size=4, **kwargs)


def request(
    rid: str, constraint: Constraint | None, prompt: str = "go:", **sampling: Any
) -> Request:
    sampling.setdefault("max_tokens", 40)
    return Request(
        rid,
        list(prompt.encode()),
        SamplingParams(constraint=constraint, **sampling),
        eos_token_ids=(EOS_TOKEN_ID,),
    )


def text(ids: list[int]) -> str:
    return bytes(t for t in ids if t < 256).decode()


# ---------------------------------------------------------------------- the compiler


def test_bad_constraints_raise_the_library_reason() -> None:
    """An uncompilable regex, an invalid schema, a bad choice list and a bad grammar raise
    ConstraintError naming what is wrong."""
    compiler = byte_compiler()
    cases = [
        (Constraint("regex", "a[bc"), "unclosed character class"),
        (Constraint("json_schema", '{"type": "foo"}'), "Invalid type: foo"),
        (Constraint("json_schema", "{not json"), "invalid json_schema"),
        (Constraint("choice", "[]"), "non-empty list"),
        (Constraint("grammar", "start: undefined_rule"), "undefined_rule"),
    ]
    for constraint, reason in cases:
        with pytest.raises(ConstraintError, match=reason):
            compiler.compile(constraint)


def test_compile_cache_counts_hits() -> None:
    """Equal constraints compile once; later checks are cache hits (a runner's matcher copy
    is not a hit: the request was counted when it was checked)."""
    compiler = byte_compiler()
    compiler.compile(REGEX)
    compiler.compile(Constraint("regex", r"(ab|cd)+x"))
    compiler.new_matcher(REGEX)
    assert (compiler.num_compiled_total, compiler.num_cache_hits_total) == (1, 1)


def test_an_unchecked_bad_constraint_fails_its_request_alone() -> None:
    """A constraint that reaches the runner without a front end's check and does not
    compile fails that request (ModelOutput.failed); the batch carries on."""
    tracker = ConstraintTracker(byte_compiler())
    reqs = [request("bad", Constraint("regex", "a[")), request("ok", None, max_tokens=3)]
    kv = KVCacheManager(KVCacheConfig(num_blocks=16, block_size=4))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), kv)
    for r in reqs:
        scheduler.add_request(r)
    plan = scheduler.schedule()
    result = fake_runner(tracker).execute(plan)
    assert list(result.failed) == ["bad"] and "unclosed character class" in result.failed["bad"]
    assert list(result.sampled_token_ids) == ["ok"]


def test_constraint_excludes_ignore_eos_and_min_tokens() -> None:
    """The constraint decides where the output ends: ignore_eos / min_tokens are refused."""
    with pytest.raises(SamplingParamsError, match="ignore_eos cannot be combined"):
        SamplingParams(constraint=REGEX, ignore_eos=True)
    with pytest.raises(SamplingParamsError, match="min_tokens cannot be combined"):
        SamplingParams(constraint=REGEX, min_tokens=1)


def test_masks_of_draft_rows_and_rollback() -> None:
    """Row i of a decode with drafts is the mask after i drafts; rows after a draft the
    grammar rejects allow everything; the matcher stays at the accepted tokens."""
    from scheduler.output import ScheduledSeq

    compiler = byte_compiler()
    tracker = ConstraintTracker(compiler)
    sampling = SamplingParams(constraint=REGEX)
    a, b, c, x = (ord(ch) for ch in "abcx")
    seq = ScheduledSeq(
        "r", [a, b, ord("z"), c], 4, [0, 1], sampling, True,
        all_token_ids=[*b"go:", a], num_prompt_tokens=3, num_draft_tokens=3,
    )  # fmt: skip
    masks = tracker.compute_masks([seq])
    assert masks.bitmask is not None
    rows = [allowed_token_ids(row, 258) for row in masks.bitmask]
    assert rows[:2] == [[b], [a, c, x]]
    assert rows[2] == rows[3] == list(range(258))
    assert tracker.token_ids("r") == [a]
    assert tracker.accept(seq, [b, c]) is None
    assert tracker.token_ids("r") == [a, b, c]
    # A draft that ends the grammar (x, then EOS): the row after EOS allows anything rather
    # than nothing (a stopped matcher), so the request does not fail on a don't-care row.
    # (From the output "ab": the matcher at "abc" rolls back one token first.)
    seq = ScheduledSeq(
        "r", [b, x, EOS_TOKEN_ID, a], 4, [0, 1, 2], sampling, True,
        all_token_ids=[*b"go:", a, b], num_prompt_tokens=3, num_draft_tokens=3,
    )  # fmt: skip
    masks = tracker.compute_masks([seq])
    assert masks.bitmask is not None and not masks.failed
    rows = [allowed_token_ids(row, 258) for row in masks.bitmask]
    assert rows[:3] == [[a, c, x], [EOS_TOKEN_ID], list(range(258))]
    assert rows[3] == list(range(258))
    assert tracker.token_ids("r") == [a, b]
    assert "leaves the constraint" in (tracker.accept(seq, [ord("q")]) or "")


# ---------------------------------------------------------------------- fake runner


def test_fake_runner_outputs_match_and_stop() -> None:
    """Regex, schema and choice requests next to an unconstrained one: every token in the
    mask, each constrained output matches and ends with stop (EOS)."""
    import json
    import re

    tracker = ConstraintTracker(byte_compiler())
    reqs = [
        request("re", REGEX),
        request("js", SCHEMA, max_tokens=60),
        request("ch", CHOICE),
        request("free", None, max_tokens=8),
    ]
    outputs, finish, _ = run(fake_runner(tracker), tracker, reqs)
    for rid in ("re", "js", "ch"):
        assert finish[rid] is FinishReason.STOP and outputs[rid][-1] == EOS_TOKEN_ID
    assert re.fullmatch(r"(ab|cd)+x", text(outputs["re"]))
    value = json.loads(text(outputs["js"]))
    assert set(value) == {"k", "n"} and value["k"] in ("yes", "no") and 0 <= value["n"] <= 99
    assert text(outputs["ch"]) in ("red", "green", "blue")
    assert finish["free"] is FinishReason.LENGTH and len(outputs["free"]) == 8
    assert len(tracker) == 0  # every finished request's state was dropped


def test_fake_runner_n_samples_each_their_own_state() -> None:
    """n = 3 samples of one constrained request keep three matchers, each equal to the
    replay of its own sample's tokens (run checks it every step)."""
    tracker = ConstraintTracker(byte_compiler())
    reqs = [request("r", SCHEMA, n=3, max_tokens=100)]
    outputs, finish, _ = run(fake_runner(tracker), tracker, reqs, num_blocks=96)
    assert set(outputs) == {"r", "r#1", "r#2"}
    assert all(reason is FinishReason.STOP for reason in finish.values())
    assert len({tuple(v) for v in outputs.values()}) == 3  # three different samples


def test_fake_runner_preemption_rebuilds_state() -> None:
    """With too few blocks the scheduler preempts and recomputes; the matchers stay equal to
    a replay of the tokens, and outputs equal the run without preemption."""
    tracker = ConstraintTracker(byte_compiler())
    reqs = [request(f"r{i}", SCHEMA, max_tokens=60, prompt=f"p{i}:") for i in range(4)]
    roomy, _, _ = run(fake_runner(tracker), tracker, reqs)
    tracker = ConstraintTracker(byte_compiler())
    reqs = [request(f"r{i}", SCHEMA, max_tokens=60, prompt=f"p{i}:") for i in range(4)]
    tight, _, scheduler = run(fake_runner(tracker), tracker, reqs, num_blocks=18)
    assert scheduler.make_stats().num_preemptions_total > 0
    assert tight == roomy


def test_fake_runner_lost_state_is_replayed() -> None:
    """A matcher dropped mid-request (as after a runner restart) is rebuilt from the tokens."""
    tracker = ConstraintTracker(byte_compiler())
    runner = fake_runner(tracker)
    kv = KVCacheManager(KVCacheConfig(num_blocks=64, block_size=4))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), kv)
    scheduler.add_request(request("r", SCHEMA, max_tokens=60))
    for _ in range(6):
        plan = scheduler.schedule()
        scheduler.update(plan, runner.execute(plan))
    req = scheduler.get_request("r")
    assert req is not None and len(req.output_token_ids) == 6
    tracker.drop(["r"])
    plan = scheduler.schedule()
    scheduler.update(plan, runner.execute(plan))
    assert tracker.token_ids("r") == req.output_token_ids


def test_fake_runner_speculation_accepts_and_rolls_back() -> None:
    """n-gram drafts on a constrained request: drafts the grammar allows are accepted, a
    draft it rejects is not, and the matcher equals the replay after every step."""
    tracker = ConstraintTracker(byte_compiler())
    # The script prefers "abcdabcd..." (it fits (ab|cd)+x), so drafts from the prompt's
    # "abcdabcd" are accepted; the prompt's "abz" makes the drafter propose 'z', which the
    # grammar refuses; at the end the script prefers 'y', refused too.
    script = {"s": list(b"abcdabcdababy")}
    reqs = [request("s", REGEX, prompt="abcdabcdabzabz", max_tokens=40)]
    outputs, finish, scheduler = run(
        fake_runner(tracker, script=script), tracker, reqs,
        speculative="ngram", num_speculative_tokens=3, ngram_max=3, ngram_min=1,
    )  # fmt: skip
    stats = scheduler.make_stats()
    assert stats.num_spec_accepted_tokens_total > 0
    assert stats.num_spec_draft_tokens_total > stats.num_spec_accepted_tokens_total
    assert text(outputs["s"]).startswith("abcdabcdabab")
    assert finish["s"] is FinishReason.STOP


def test_fake_runner_abort_drops_state() -> None:
    """An aborted constrained request's matcher is dropped at the next step; the others
    carry on consistent."""
    tracker = ConstraintTracker(byte_compiler())
    reqs = [request("a", SCHEMA, max_tokens=60), request("b", SCHEMA, max_tokens=60)]
    _, finish, _ = run(fake_runner(tracker), tracker, reqs, abort_after={"a": 5})
    assert finish["a"] is FinishReason.ABORT and finish["b"] is FinishReason.STOP
    assert tracker.token_ids("a") is None and len(tracker) == 0


# ---------------------------------------------------------------------- tiny real model


@pytest.fixture(scope="module")
def tiny_runner() -> Any:
    from tests.model_runner.oracle import make_runner, tiny_hf

    tracker = ConstraintTracker(ConstraintCompiler(TinyTokenizer()))
    return make_runner(tiny_hf("llama"), num_blocks=128, block_size=4, constraints=tracker)


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_tiny_model_tokens_in_mask(tiny_runner: Any, speculative: str) -> None:
    """On a random-weight model at temperature 1: n = 2, a preempting cache, drafts and an
    abort, every token lies in its mask and the states equal the replays."""
    tracker = tiny_runner.constraints
    prompt = "abcdabcdabcd"

    def tiny(rid: str, constraint: Constraint, **kw: Any) -> Request:
        sampling = SamplingParams(constraint=constraint, temperature=1.0, seed=7, **kw)
        return Request(rid, list(prompt.encode()), sampling, eos_token_ids=(2,))

    reqs = [
        tiny("re", REGEX, max_tokens=30),
        tiny("js", SCHEMA, max_tokens=40, n=2),
        tiny("ch", CHOICE, max_tokens=10),
        tiny("ab", SCHEMA, max_tokens=40),
    ]
    spec: dict[str, Any] = {}
    if speculative == "ngram":
        spec = {"speculative": "ngram", "num_speculative_tokens": 3, "ngram_min": 1}
    outputs, finish, scheduler = run(
        tiny_runner, tracker, reqs, num_blocks=40, abort_after={"ab": 4}, **spec
    )
    assert finish["ab"] is FinishReason.ABORT
    assert set(outputs) == {"re", "js", "js#1", "ch", "ab"}
    assert finish["ch"] is FinishReason.STOP
    assert text(outputs["ch"]) in ("red\x02", "green\x02", "blue\x02")
    assert len(tracker) == 0
    if speculative == "ngram":
        assert scheduler.make_stats().num_spec_draft_tokens_total > 0
