"""The output processor on the real scheduler and FakeRunner, without the engine thread."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cache_manager import KVCacheConfig, KVCacheManager
from metrics.records import RequestRecord
from model_runner.fake import FakeRunner
from model_runner.tokenizer import DetokResult
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.output import RequestOutput
from scheduler.request import AbortReason, FinishReason
from server.fake_tokenizer import ByteTokenizer
from server.outputs import GenerationOutput, Item, OutputProcessor, TextStream
from server.text import make_text_stream_factory
from tests.server.helpers import expected_tokens, make_fake_runner

PROMPT = [65, 66, 67, 68, 69, 70]


@dataclass
class Rig:
    scheduler: Scheduler
    runner: FakeRunner
    outputs: OutputProcessor[str]
    items: list[tuple[str, Item]]
    records: list[RequestRecord]

    def add(self, rid: str, stream: str | None = None, **sampling: Any) -> None:
        request = Request(rid, list(PROMPT), SamplingParams(**sampling), eos_token_ids=(257,))
        text = self.outputs.text_stream(request)
        self.scheduler.add_request(request)
        self.outputs.add(request, stream or rid, text)

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        self.outputs.on_scheduled([s.request_id for s in plan.prefill], 0.0)
        outs = self.scheduler.update(plan, self.runner.execute(plan))
        self.outputs.process(outs, 1.0)
        return outs

    def run(self) -> None:
        while self.scheduler.has_unfinished_requests():
            self.step()

    def outs_of(self, stream: str) -> list[GenerationOutput]:
        found = [item for s, item in self.items if s == stream]
        assert all(isinstance(item, GenerationOutput) for item in found), found
        return found  # type: ignore[return-value]

    def record(self, request_id: str) -> RequestRecord:
        (found,) = [r for r in self.records if r.request_id == request_id]
        return found


def make_rig(text_factory: Any = None, **runner_kwargs: Any) -> Rig:
    kv = KVCacheManager(KVCacheConfig(num_blocks=64, block_size=4))
    config = SchedulerConfig(max_model_len=128, max_num_seqs=16, max_num_batched_tokens=256)
    scheduler = Scheduler(config, kv)
    factory = text_factory or make_text_stream_factory(ByteTokenizer())
    items: list[tuple[str, Item]] = []
    records: list[RequestRecord] = []

    def emit(stream: str, item: Item) -> None:
        items.append((stream, item))

    outputs = OutputProcessor(scheduler, factory, emit, records.append)
    return Rig(scheduler, make_fake_runner(**runner_kwargs), outputs, items, records)


def test_n3_samples_are_tracked_from_forked_ids_and_each_finishes_once() -> None:
    """n=3: the parent's output names 'r#1' and 'r#2'; the one stream carries samples 0..2,
    each with its own tokens and exactly one final item, and the last item closes it."""
    rig = make_rig()
    rig.add("r", max_tokens=4, n=3)
    forked: list[tuple[str, tuple[str, ...]]] = []
    while rig.scheduler.has_unfinished_requests():
        forked += [(o.request_id, o.forked_ids) for o in rig.step() if o.forked_ids]
    assert forked == [("r", ("r#1", "r#2"))]
    outs = rig.outs_of("r")
    for index, sid in enumerate(["r", "r#1", "r#2"]):
        mine = [o for o in outs if o.index == index]
        assert [t for o in mine for t in o.token_ids] == expected_tokens(
            rig.runner, sid, 4, owner=None
        )
        assert [(o.finished, o.finish_reason) for o in mine if o.finished] == [
            (True, FinishReason.LENGTH)
        ]
        assert {o.request_id for o in mine} == {"r"}
    assert [o.closes_stream for o in outs] == [False] * (len(outs) - 1) + [True]
    assert sorted(r.request_id for r in rig.records) == ["r", "r#1", "r#2"]
    assert rig.outputs.num_clients == 0


def test_a_fork_notice_emits_nothing_and_a_repeated_one_is_ignored() -> None:
    """An output with forked_ids but no tokens only starts tracking the samples; a later one
    (the parent's first token after a preemption) does not track them a second time."""
    rig = make_rig()
    rig.add("p", max_tokens=4, n=2)
    notice = RequestOutput("p", [], forked_ids=("p#1",))
    rig.outputs.process([notice], 1.0)
    assert rig.items == []
    child_end = RequestOutput("p#1", [7], finished=True, finish_reason=FinishReason.LENGTH)
    rig.outputs.process([child_end, RequestOutput("p", [8], forked_ids=("p#1",))], 1.0)
    parent_end = RequestOutput("p", [9], finished=True, finish_reason=FinishReason.LENGTH)
    rig.outputs.process([parent_end], 1.0)
    outs = rig.outs_of("p")
    assert [(o.index, o.token_ids, o.finished, o.closes_stream) for o in outs] == [
        (1, [7], True, False),
        (0, [8], False, False),
        (0, [9], True, True),
    ]
    assert rig.outputs.num_clients == 0


def test_a_stop_string_ends_the_request_with_the_output_finish_returns() -> None:
    """A stop string found in the text ends the request via scheduler.finish: the final item
    carries STOP, the string and the token count of finish's output; the step's output is
    left as update returned it, and the scheduler frees the request."""
    text = "hello END more"
    rig = make_rig(script={"s": list(text.encode())})
    rig.add("s", max_tokens=50, stop=("END",))
    stop_step: list[RequestOutput] = []
    while not rig.outs_of("s") or not rig.outs_of("s")[-1].finished:
        stop_step = rig.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in stop_step] == [("s", False, None)]
    last = rig.outs_of("s")[-1]
    assert (last.finish_reason, last.stop_reason, last.closes_stream) == (
        FinishReason.STOP,
        "END",
        True,
    )
    assert last.num_output_tokens == len("hello END")
    assert "".join(o.text for o in rig.outs_of("s")) == "hello "
    assert rig.record("s").finish_reason == "stop"
    assert not rig.scheduler.has_unfinished_requests()
    assert rig.scheduler.make_stats().num_finished_total == {"stop": 1}


class _BreaksOnThirdPush:
    def __init__(self, inner: TextStream) -> None:
        self.inner = inner
        self.num_pushes = 0

    def push(self, token_ids: Sequence[int]) -> DetokResult:
        self.num_pushes += 1
        if self.num_pushes == 3:
            raise UnicodeError("bad bytes")
        return self.inner.push(token_ids)  # type: ignore[return-value]

    def flush(self) -> DetokResult:
        return self.inner.flush()  # type: ignore[return-value]


def test_a_detokenizer_failure_fails_that_request_with_the_output_fail_returns() -> None:
    """push raising ends that request via scheduler.fail: its final item is ERROR with the
    reason and this step's token; the step's output is not patched; the other one runs on."""
    base = make_text_stream_factory(ByteTokenizer())

    def factory(request: Request) -> TextStream:
        stream = base(request)
        return _BreaksOnThirdPush(stream) if request.request_id == "bad" else stream

    rig = make_rig(text_factory=factory)
    rig.add("bad", max_tokens=8)
    rig.add("ok", max_tokens=8)
    rig.step()
    rig.step()
    outs = rig.step()
    (bad_out,) = [o for o in outs if o.request_id == "bad"]
    assert (bad_out.finished, bad_out.finish_reason, bad_out.error) == (False, None, None)
    last = rig.outs_of("bad")[-1]
    assert (last.finished, last.finish_reason, last.closes_stream) == (
        True,
        FinishReason.ERROR,
        True,
    )
    assert last.error is not None and "detokenization failed" in last.error
    assert "bad bytes" in last.error
    assert last.token_ids == bad_out.new_token_ids and last.num_output_tokens == 3
    rig.run()
    assert rig.record("bad").finish_reason == "error"
    assert rig.record("ok").finish_reason == "length"
    assert rig.scheduler.make_stats().num_finished_total == {"error": 1, "length": 1}


def test_aborting_a_forked_client_ends_every_sample_within_the_call() -> None:
    """abort(client) aborts the forked samples, then sample 0: all three final items are out
    before it returns, the last closes the stream, and the records say client_cancel."""
    rig = make_rig()
    rig.add("r", max_tokens=20, n=3)
    while not any(o.index == 2 for o in rig.outs_of("r")):
        rig.step()
    before = len(rig.items)
    assert rig.outputs.abort("r", AbortReason.CLIENT_CANCEL, 2.0)
    ends = rig.outs_of("r")[before:]
    assert [(o.index, o.finish_reason, o.closes_stream) for o in ends] == [
        (2, FinishReason.ABORT, False),
        (1, FinishReason.ABORT, False),
        (0, FinishReason.ABORT, True),
    ]
    assert {r.request_id: r.abort_reason for r in rig.records} == {
        "r": "client_cancel",
        "r#1": "client_cancel",
        "r#2": "client_cancel",
    }
    assert rig.outputs.num_clients == 0 and not rig.outputs.abort("r", AbortReason.ABORT_CALL, 3.0)


def test_aborting_a_waiting_client_records_its_reason_once() -> None:
    """A client cancelled before its request ever ran: the scheduler ends it with ABORT (its
    stats count one abort), and the one record, which metrics count aborts from, says
    client_cancel."""
    rig = make_rig()
    rig.add("w", max_tokens=4)
    assert rig.outputs.abort("w", AbortReason.CLIENT_CANCEL, 1.0)
    (last,) = rig.outs_of("w")
    assert (last.finished, last.finish_reason, last.closes_stream) == (
        True,
        FinishReason.ABORT,
        True,
    )
    assert [(r.request_id, r.finish_reason, r.abort_reason) for r in rig.records] == [
        ("w", "abort", "client_cancel")
    ]
    assert rig.scheduler.make_stats().num_finished_total == {"abort": 1}
    assert not rig.scheduler.has_unfinished_requests()
