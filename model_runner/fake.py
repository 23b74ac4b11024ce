"""FakeRunner: a runner without a model, for scheduler and server tests. No torch.

Tokens are deterministic. For a scheduled seq that samples (``do_sample``), the token at
output index ``i = seq.num_output_tokens`` is, in this order of precedence:

1. ``script[request_id][i]`` when the request has a script and ``i < len(script)``;
2. otherwise ``default_token(key, i)``::

       h = blake2b(f"{seed}:{key}:{i}", digest_size=8) as a big-endian int
       token = h % vocab_size, bumped by +1 (mod vocab_size) past any EOS id

   where ``key`` is the request id (``key_by="request_id"``, the default) or the prompt's
   token ids joined by commas (``key_by="prompt"``, so identical prompts get identical
   continuations whatever their ids). Default tokens never hit EOS: a request runs to
   ``max_tokens`` unless its script says otherwise.

A constrained request (``sampling.constraint``, with a ``ConstraintTracker``) keeps that
token when its mask allows it, else takes ``allowed[h % len(allowed)]`` from the ascending
allowed ids; drafts are verified against that same rule, row by row of the draft masks.

Because the token is keyed on the output index, a request preempted and re-prefilled gets the
same continuation it would have got without preemption.

Speculative drafts (``seq.num_draft_tokens``) are verified greedily against the same rule:
draft i is accepted while it equals the token at output index ``num_output_tokens + i``, and
the token after the accepted ones is sampled as usual; so output never depends on drafts.

Scheduling one step ahead: a seq whose input token is a placeholder (``has_placeholder``)
takes the token this runner sampled for its request in the step before, as a device would.

The fake device (``step_thread=True``): ``submit`` returns at once and the step runs on a
worker thread (taking ``sleep_s``), with a copy of everything it reads from the plan taken in
``submit`` (the engine applies the previous step meanwhile). ``spans`` records, per step, when
it was submitted and when it finished. ``hold_steps=True`` keeps each step from finishing
until the next one is submitted or its result is asked for: an engine that plans ahead
submits first, a synchronous one asks first, so the overlap shows in ``spans`` whatever the
machine's speed.

For tests the runner can also:

- fail one request: ``fail_request(rid, error)`` puts it into ``ModelOutput.failed`` the next
  time it is scheduled (the rest of the batch continues);
- fail a step: ``crash_next_step(exc)`` makes the next ``execute`` raise (a transient
  failure), ``crash_at_step=N`` every ``execute`` from engine step N on (a dead device);
- sleep ``sleep_s`` per step plus ``sleep_per_token_s`` per scheduled token to emulate compute;
- verify the plan against a shadow paged KV (``verify_kv_block_size``): every scheduled
  token is written into ``(block_id, offset)`` slots after applying ``block_copies``, and
  every position a seq attends to must hold exactly ``all_token_ids[pos]``. This catches a
  wrong block table, a wrong prefix hit or a missing copy-on-write in the scheduler/cache
  manager. Positions in ``verify_kv_null_block_id`` (the null block that a sliding window
  points released table entries at) are not checked and must never be written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from cache_manager.sizing import ModelShape
from model_runner.base import DoneStep, ModelInfo, NullBlockIO, PendingStep, StepHandle
from scheduler.output import ModelOutput, ScheduledSeq, SchedulerOutput, TokenLogprobs

if TYPE_CHECKING:
    import numpy as np

    from model_runner.constraints import ConstraintTracker

KeyBy = Literal["request_id", "prompt"]


def make_fake_info(
    vocab_size: int = 32_000,
    max_model_len: int = 4096,
    eos_token_ids: tuple[int, ...] = (2,),
    name: str = "fake",
    bos_token_id: int | None = 1,
) -> ModelInfo:
    """A small ModelInfo for tests (the shape only sizes KV memory figures)."""
    return ModelInfo(
        name=name,
        vocab_size=vocab_size,
        max_model_len=max_model_len,
        shape=ModelShape(num_layers=2, num_kv_heads=2, head_dim=8, dtype_bytes=4, name=name),
        eos_token_ids=eos_token_ids,
        bos_token_id=bos_token_id,
        dtype="float32",
        device="cpu",
    )


class FakeRunnerCrash(RuntimeError):
    """Raised by ``FakeRunner.execute`` when told to emulate runner death."""


@dataclass(slots=True)
class StepSpan:
    """When a step of the fake device was submitted and finished (``time.perf_counter``)."""

    step_id: int
    submitted_s: float
    finished_s: float | None = None


class FakeRunner:
    """A deterministic runner without a model; see the module docstring for the token rule."""

    def __init__(
        self,
        info: ModelInfo | None = None,
        script: Mapping[str, Sequence[int]] | None = None,
        seed: int = 0,
        *,
        key_by: KeyBy = "request_id",
        sleep_s: float = 0.0,
        sleep_per_token_s: float = 0.0,
        fail_requests: Mapping[str, str] | None = None,
        crash_at_step: int | None = None,
        verify_kv_block_size: int | None = None,
        verify_kv_null_block_id: int | None = None,
        record_plans: bool = False,
        constraints: ConstraintTracker | None = None,
        step_thread: bool = False,
        hold_steps: bool = False,
    ) -> None:
        if key_by not in ("request_id", "prompt"):
            raise ValueError(f"key_by must be 'request_id' or 'prompt', got {key_by!r}")
        if sleep_s < 0 or sleep_per_token_s < 0:
            raise ValueError(
                f"sleep_s and sleep_per_token_s must be >= 0, got {sleep_s}, {sleep_per_token_s}"
            )
        if verify_kv_block_size is not None and verify_kv_block_size < 1:
            raise ValueError(f"verify_kv_block_size must be >= 1, got {verify_kv_block_size}")
        self._info = info if info is not None else make_fake_info()
        if self._info.vocab_size <= len(set(self._info.eos_token_ids)):
            raise ValueError(
                f"vocab_size {self._info.vocab_size} leaves no non-EOS token "
                f"(eos ids {list(self._info.eos_token_ids)})"
            )
        self.script: dict[str, list[int]] = {k: list(v) for k, v in (script or {}).items()}
        self.seed = seed
        self.key_by: KeyBy = key_by
        self.sleep_s = sleep_s
        self.sleep_per_token_s = sleep_per_token_s
        self._fail: dict[str, str] = dict(fail_requests or {})
        self._crash_at_step = crash_at_step
        self._crash_next: BaseException | None = None
        self._crash_always: BaseException | None = None
        self._eos = frozenset(self._info.eos_token_ids)
        self._keys: dict[str, str] = {}
        self._kv_block_size = verify_kv_block_size
        self._kv_null_block_id = verify_kv_null_block_id
        self._kv_slots: dict[int, list[int | None]] = {}
        self.scrubbed: list[list[int]] = []  # block ids of each ``scrub_blocks`` call
        self.num_steps = 0
        self.plans: list[SchedulerOutput] | None = [] if record_plans else None
        self.constraints = constraints
        self._mask_rows: dict[str, int] = {}  # this step: request id -> its first mask row
        self._masks: np.ndarray | None = None
        self._last_sampled: dict[str, int] = {}  # the previous step's tokens (placeholders)
        self._last_failed: set[str] = set()
        # The fake device: steps on a worker thread (see the module docstring).
        self._device = ThreadPoolExecutor(1, "fake-device") if step_thread else None
        self.hold_steps = hold_steps
        self.spans: list[StepSpan] = []
        self._held: threading.Event | None = None  # the last submitted step's release

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def can_run_ahead(self) -> bool:
        """Whether ``submit`` returns before the step is computed (``step_thread``)."""
        return self._device is not None

    @property
    def adapters(self) -> None:
        """No weights, so no LoRA adapters."""
        return None

    # -- the shadow KV as block bytes (tier 2) -------------------------------------------

    def block_io(self) -> ShadowBlockIO | NullBlockIO:
        """The shadow KV as block bytes (``ShadowBlockIO``), or no bytes without one."""
        if self._kv_block_size is None:
            return NullBlockIO()
        return ShadowBlockIO(self, self._kv_block_size)

    def scrub_blocks(self, block_ids: Sequence[int]) -> None:
        """No KV values to poison: the ids are recorded (``scrubbed``, one list per call)."""
        self.scrubbed.append(list(block_ids))

    def read_kv_block(self, block_id: int) -> list[int | None]:
        """The token each slot of ``block_id`` holds in the shadow KV (None: never written)."""
        assert self._kv_block_size is not None, "no shadow KV (verify_kv_block_size)"
        return list(self._kv_slots.get(block_id, [None] * self._kv_block_size))

    def write_kv_block(self, block_id: int, slots: Sequence[int | None]) -> None:
        """Overwrite the shadow KV of ``block_id`` (a restore from tier 2)."""
        assert self._kv_block_size is not None and len(slots) == self._kv_block_size
        self._kv_slots[block_id] = list(slots)

    # -- test controls ------------------------------------------------------------------

    def set_script(self, request_id: str, token_ids: Iterable[int]) -> None:
        """Output token ``i`` of ``request_id`` will be ``token_ids[i]`` (default after)."""
        self.script[request_id] = list(token_ids)

    def fail_request(self, request_id: str, error: str = "injected failure") -> None:
        """The next time ``request_id`` is scheduled it lands in ``ModelOutput.failed``."""
        self._fail[request_id] = error

    def crash_next_step(self, exc: BaseException | None = None) -> None:
        """The next ``execute`` raises ``exc`` (default ``FakeRunnerCrash``)."""
        self._crash_next = exc if exc is not None else FakeRunnerCrash("fake runner died")

    def crash_every_step(self, exc: BaseException | None = None) -> None:
        """Every ``execute`` from now on raises ``exc`` (a dead device), as ``crash_at_step``
        does from its step on."""
        self._crash_always = exc if exc is not None else FakeRunnerCrash("fake runner is dead")

    # -- the token rule -----------------------------------------------------------------

    def default_token(self, key: str, index: int) -> int:
        """The documented pure function of (key, output index); never an EOS id."""
        digest = hashlib.blake2b(f"{self.seed}:{key}:{index}".encode(), digest_size=8).digest()
        vocab = self._info.vocab_size
        token = int.from_bytes(digest, "big") % vocab
        while token in self._eos:
            token = (token + 1) % vocab
        return token

    def token_for(self, seq: ScheduledSeq, offset: int = 0) -> int:
        """The token this runner samples for ``seq`` (index = ``seq.num_output_tokens``,
        plus ``offset`` for the position after ``offset`` drafts)."""
        index = seq.num_output_tokens + offset
        scripted = self.script.get(seq.request_id)
        if scripted is not None and index < len(scripted):
            token = scripted[index]
        else:
            token = self.default_token(self._key(seq), index)
        first_row = self._mask_rows.get(seq.request_id)
        if first_row is None or self._masks is None:
            return token
        from model_runner.constraints import allowed_token_ids, is_allowed

        mask_row = self._masks[first_row + offset]
        if is_allowed(mask_row, token):
            return token
        allowed = allowed_token_ids(mask_row, self._info.vocab_size)
        return allowed[self.default_token(self._key(seq), index) % len(allowed)]

    def _key(self, seq: ScheduledSeq) -> str:
        if self.key_by == "request_id":
            return seq.request_id
        key = self._keys.get(seq.request_id)
        if key is None:
            prompt = seq.all_token_ids[: seq.num_prompt_tokens]
            key = ",".join(map(str, prompt))
            self._keys[seq.request_id] = key
        return key

    # -- one step -----------------------------------------------------------------------

    def submit(self, plan: SchedulerOutput) -> StepHandle:
        """Start ``plan`` (``base.Runner.submit``): on the fake device, a copy of what the step
        reads is taken now and the step runs on the worker; without it, ``execute`` now."""
        if self._device is None:
            return DoneStep(self.execute(plan))
        span = StepSpan(plan.step_id, time.perf_counter())
        self.spans.append(span)
        if self._held is not None:
            self._held.set()  # the step before may finish: the next one is submitted
        release = threading.Event()
        if not self.hold_steps:
            release.set()
        self._held = release
        future = self._device.submit(self._device_step, _snapshot(plan), span, release)
        return PendingStep(lambda: _wait(future, release))

    def _device_step(
        self, plan: SchedulerOutput, span: StepSpan, release: threading.Event
    ) -> ModelOutput:
        try:
            return self.execute(plan)
        finally:
            release.wait()
            span.finished_s = time.perf_counter()

    def shutdown(self) -> None:
        """Stop the fake device's worker (the steps submitted still finish)."""
        if self._held is not None:
            self._held.set()
        if self._device is not None:
            self._device.shutdown(wait=True)

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        """Sample one token per ``do_sample`` seq; never mutates ``plan``."""
        self.num_steps += 1
        if self.plans is not None:
            self.plans.append(plan)
        for rid in plan.finished_request_ids:
            self._keys.pop(rid, None)
        if self._crash_next is not None:
            exc, self._crash_next = self._crash_next, None
            raise exc
        if self._crash_always is not None:
            raise self._crash_always
        if self._crash_at_step is not None and plan.step_id >= self._crash_at_step:
            raise FakeRunnerCrash(
                f"fake runner died at step {self._crash_at_step} (step {plan.step_id})"
            )
        if self._kv_block_size is not None:
            self._verify_kv(plan, self._kv_block_size)

        out = ModelOutput()
        start = time.perf_counter()
        self._compute_masks(plan, out)
        self._run_batch(plan.prefill, out)
        mid = time.perf_counter()
        self._run_batch(plan.decode, out)
        if self.sleep_s or self.sleep_per_token_s:
            time.sleep(self.sleep_s + self.sleep_per_token_s * plan.num_scheduled_tokens)
        end = time.perf_counter()
        out.prefill_time_s = mid - start
        out.decode_time_s = end - mid
        self._last_sampled = dict(out.sampled_token_ids)
        self._last_failed = set(out.failed)
        return out

    def _input_token(self, seq: ScheduledSeq) -> int | None:
        """The token a placeholder stands for: what this request sampled in the step before;
        None when that step failed it (this seq's result is stale: the request ends there)."""
        rid = seq.request_id
        if rid in self._last_sampled:
            return self._last_sampled[rid]
        if rid in self._last_failed:
            return None
        raise AssertionError(f"{rid}: a placeholder token, but the step before sampled none for it")

    def _compute_masks(self, plan: SchedulerOutput, out: ModelOutput) -> None:
        """This step's masks of the constrained seqs that sample (see the module docstring)."""
        self._mask_rows, self._masks = {}, None
        if self.constraints is None:
            return
        self.constraints.drop(plan.finished_request_ids)
        seqs = [s for s in (*plan.prefill, *plan.decode) if s.do_sample]
        if not any(s.sampling.constraint is not None for s in seqs):
            return
        masks = self.constraints.compute_masks(seqs)
        out.failed.update(masks.failed)
        out.constraint_mask_time_s = masks.compute_time_s
        self._masks = masks.bitmask
        row = 0
        for s in seqs:
            if s.sampling.constraint is not None and s.request_id not in masks.failed:
                self._mask_rows[s.request_id] = row
            row += 1 + s.num_draft_tokens

    def _run_batch(self, batch: list[ScheduledSeq], out: ModelOutput) -> None:
        for seq in batch:
            error = self._fail.pop(seq.request_id, None)
            if error is not None:
                out.failed[seq.request_id] = error
                continue
            if seq.request_id in out.failed:
                continue
            if seq.num_prompt_logprobs:
                # Scripted like the sampled logprobs: each prompt token its own top one.
                top_n = seq.sampling.prompt_logprobs or 0
                after = seq.all_token_ids[seq.start_pos + 1 : seq.end_pos + 1]
                scored = after[: seq.num_prompt_logprobs]
                out.prompt_logprobs[seq.request_id] = [self._logprobs(t, top_n) for t in scored]
            if not seq.do_sample:
                continue
            num_accepted = 0
            for draft in seq.token_ids[len(seq.token_ids) - seq.num_draft_tokens :]:
                if draft != self.token_for(seq, num_accepted):
                    break
                num_accepted += 1
            if seq.num_draft_tokens:
                out.num_accepted_drafts[seq.request_id] = num_accepted
            token = self.token_for(seq, num_accepted)
            if self.constraints is not None and seq.request_id in self._mask_rows:
                drafts = seq.token_ids[1 : 1 + num_accepted]
                error = self.constraints.accept(seq, [*drafts, token])
                if error is not None:
                    out.failed[seq.request_id] = error
                    out.num_accepted_drafts.pop(seq.request_id, None)
                    continue
            out.sampled_token_ids[seq.request_id] = token
            if seq.sampling.logprobs is not None:
                out.logprobs[seq.request_id] = self._logprobs(token, seq.sampling.logprobs)

    def _logprobs(self, token: int, num_top: int) -> TokenLogprobs:
        # The sampled token is the most likely; alternatives are its neighbours in the vocab.
        vocab = self._info.vocab_size
        top = tuple(((token + k) % vocab, -0.5 * k) for k in range(num_top))
        return TokenLogprobs(token_id=token, logprob=0.0, top=top)

    def _verify_kv(self, plan: SchedulerOutput, block_size: int) -> None:
        slots = self._kv_slots
        null = self._kv_null_block_id
        for src, dst in plan.block_copies:
            slots[dst] = list(slots.get(src, [None] * block_size))
        for seq in (*plan.prefill, *plan.decode):
            if seq.end_pos > len(seq.block_ids) * block_size:
                raise AssertionError(
                    f"{seq.request_id}: {len(seq.block_ids)} blocks of {block_size} cannot hold "
                    f"positions up to {seq.end_pos - 1}"
                )
            expected = list(seq.all_token_ids)
            token_ids = list(seq.token_ids)
            if seq.num_draft_tokens:
                expected += seq.token_ids[-seq.num_draft_tokens :]
            if seq.has_placeholder:
                token = self._input_token(seq)
                if token is None:
                    continue  # planned ahead of its failure: nothing to check, nothing kept
                token_ids[-1] = token
                expected.append(token)
            if expected[seq.start_pos : seq.end_pos] != token_ids:
                raise AssertionError(
                    f"{seq.request_id}: token_ids {seq.token_ids} != all_token_ids"
                    f"[{seq.start_pos}:{seq.end_pos}]"
                )
            if seq.do_sample != (seq.end_pos == len(expected)) or (
                seq.num_draft_tokens and not seq.do_sample
            ):
                raise AssertionError(
                    f"{seq.request_id}: do_sample={seq.do_sample} but the chunk ends at "
                    f"{seq.end_pos} of {len(expected)} known tokens"
                )
            for offset, token in enumerate(token_ids):
                pos = seq.start_pos + offset
                block_id = seq.block_ids[pos // block_size]
                if block_id == null:
                    raise AssertionError(f"{seq.request_id}: writes position {pos} to a null block")
                slots.setdefault(block_id, [None] * block_size)[pos % block_size] = token
            for pos in range(seq.end_pos):
                block_id = seq.block_ids[pos // block_size]
                if block_id == null:
                    continue
                held = slots.get(block_id, [None] * block_size)[pos % block_size]
                if held != expected[pos]:
                    raise AssertionError(
                        f"{seq.request_id}: position {pos} in block {block_id} holds {held}, "
                        f"expected {expected[pos]}"
                    )


def _snapshot(plan: SchedulerOutput) -> SchedulerOutput:
    """``plan`` with its own copy of each seq's token history: the device reads these while
    the engine appends the previous step's tokens to the requests' lists."""
    copy = dataclasses.replace

    def seqs(batch: list[ScheduledSeq]) -> list[ScheduledSeq]:
        return [copy(s, all_token_ids=list(s.all_token_ids)) for s in batch]

    return copy(plan, prefill=seqs(plan.prefill), decode=seqs(plan.decode))


def _wait(future: Future[ModelOutput], release: threading.Event) -> ModelOutput:
    release.set()  # asked for its result: a held step may finish
    return future.result()


class ShadowBlockIO:
    """A ``FakeRunner``'s shadow KV (the token id each slot holds) as block bytes, so tier-2
    tests check that a restored block holds exactly the tokens of its position."""

    def __init__(self, runner: FakeRunner, block_size: int) -> None:
        self._runner = runner
        self._fmt = struct.Struct(f"<{block_size}q")
        self.block_bytes = self._fmt.size

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        read = self._runner.read_kv_block
        return [self._fmt.pack(*(-1 if t is None else t for t in read(b))) for b in block_ids]

    def write_blocks(
        self, block_ids: Sequence[int], payloads: Sequence[bytes | memoryview]
    ) -> None:
        for block_id, payload in zip(block_ids, payloads, strict=True):
            self._runner.write_kv_block(
                block_id, [None if t < 0 else t for t in self._fmt.unpack(payload)]
            )
