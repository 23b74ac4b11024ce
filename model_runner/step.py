"""One step as the runner computes it: ``StepRows``, built once per step in
``TorchRunner.execute`` from the plan, passed down to the path that runs it, never stored.

A step is one flat batch of token rows::

    rows | chunk a (Ta) | chunk b (Tb) | verify v (1 + k) | dec 0 | dec 1 | ... | dec B-1 |
         `-- prefill --------------'`-- decodes with drafts -'`-- one row each, longest first
         `-------- chunks: attend over their request's cached prefix --'

Row r computes ``token_ids[r]`` at ``positions[r]``, writes its K/V to ``slot_mapping[r]``
(``block_id * block_size + offset``) and reads keys through its request's block table
(``block_tables()[r]``). A decode with k drafts is k + 1 rows sharing one table, each
attending up to its own position. The rows whose logits are sampled are ``sample_rows()``:
a sampling chunk's last row, every row of a sampling decode.

A decode planned one step ahead has no token id on the host: its row holds the negative id
``model_runner.future.Placeholders`` gives it, which the model's embedding resolves on the
device.

Pure Python (no torch): the runner's paths and the attention backends turn it into tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from model_runner.lora.plan import LoraStep, not_loaded
from scheduler.output import ScheduledSeq, SchedulerOutput
from scheduler.request import LoraRef

if TYPE_CHECKING:
    from model_runner.future import Placeholders
    from model_runner.lora.layout import LoraWeights

# The runner's adapters by reference: their weights, or None when not resident.
AdapterLookup = Callable[[LoraRef], "LoraWeights | None"]


@dataclass(frozen=True, slots=True)
class StepLimits:
    """What every scheduled seq must fit: the runner's start-up constants."""

    block_size: int
    num_blocks: int
    max_model_len: int
    vocab_size: int
    sliding_window: int | None = None
    # Attention sinks stream past the context: positions are not bounded by max_model_len.
    unbounded_positions: bool = False
    # The sliding layers' own pool (``KVPool.num_window_blocks``; its ids follow the
    # others') and their window: 0 / None without one.
    num_window_blocks: int = 0
    layer_window: int | None = None

    def seq_error(self, seq: ScheduledSeq, is_decode: bool, input_known: bool = True) -> str | None:
        """Why ``seq`` cannot run (inconsistent entry, positions, token ids or block
        table), or None. ``input_known`` False: its last token is a placeholder, which
        ``Placeholders.substitute`` checked."""
        n = len(seq.token_ids)
        num_drafts = seq.num_draft_tokens
        if n == 0 or (is_decode and n != 1 + num_drafts) or (num_drafts and not is_decode):
            kind = "decode" if is_decode else "prefill"
            return f"{kind} entry with {n} tokens and {num_drafts} drafts"
        if num_drafts and not seq.do_sample:
            return f"decode entry with {num_drafts} drafts that does not sample"
        if seq.start_pos < 0 or (seq.end_pos > self.max_model_len and not self.unbounded_positions):
            return (
                f"positions {seq.start_pos}..{seq.end_pos - 1} outside the model's "
                f"max_model_len {self.max_model_len}"
            )
        known = seq.token_ids if input_known else seq.token_ids[:-1]
        if known and (min(known) < 0 or max(known) >= self.vocab_size):
            return f"token id outside the vocabulary of {self.vocab_size}"
        bs = self.block_size
        needed = -(-seq.end_pos // bs)
        if len(seq.block_ids) < needed:
            return (
                f"block table of {len(seq.block_ids)} blocks cannot hold position "
                f"{seq.end_pos - 1} with block_size {bs}"
            )
        first = 0
        if self.sliding_window is not None:
            first = max(0, seq.start_pos - self.sliding_window + 1) // bs
        used = seq.block_ids[first:needed]
        if min(used) < 0 or max(used) >= self.num_blocks:
            return f"block id outside the pool of {self.num_blocks} blocks in {list(used)}"
        if self.num_window_blocks:
            return self._window_table_error(seq, needed)
        return None

    def _window_table_error(self, seq: ScheduledSeq, needed: int) -> str | None:
        """Why ``seq``'s table in the sliding layers' pool cannot serve it, or None."""
        table = seq.window_block_ids
        if table is None or len(table) < needed:
            return f"no table of {needed} blocks for the sliding layers' pool"
        assert self.layer_window is not None
        first = max(0, seq.start_pos - self.layer_window + 1) // self.block_size
        used = table[first:needed]
        low, high = self.num_blocks, self.num_blocks + self.num_window_blocks
        if min(used) < low or max(used) >= high:
            return f"sliding-layer block id outside {low}..{high - 1} in {list(used)}"
        return None


@dataclass(frozen=True, slots=True)
class StepRows:
    """The rows of one step (see the module docstring). Read-only: nothing mutates it or
    its lists after ``of`` / ``from_seqs`` built it."""

    prefill: tuple[ScheduledSeq, ...]
    decode: tuple[ScheduledSeq, ...]  # those with drafts first (see ``num_verify``)
    block_size: int
    null_block_id: int | None  # released table positions point here; never read
    num_verify: int  # decodes with drafts: the first ``num_verify`` of ``decode``
    token_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    # Seqs of the plan refused by ``StepLimits.seq_error`` (request id -> why); not rows.
    failed: Mapping[str, str] = field(default_factory=dict)
    # The rows' adapters (``lora.plan``); None when every row runs the base model.
    lora: LoraStep | None = None
    # The rows' slots in the sliding layers' own tables (``ScheduledSeq.window_block_ids``);
    # None when the seqs carry none.
    window_slot_mapping: list[int] | None = None

    @classmethod
    def of(
        cls,
        plan: SchedulerOutput,
        limits: StepLimits,
        placeholders: Placeholders | None = None,
        adapters: AdapterLookup | None = None,
    ) -> StepRows:
        """The rows of ``plan``'s seqs that fit ``limits`` (the rest in ``failed``). Decodes
        with drafts come first, then by context, longest first (the torch backend groups
        decodes of similar length, so less padding). A seq with a placeholder token runs as
        ``placeholders`` substitutes it (and without them fails); a seq with an adapter runs
        with the weights ``adapters`` gives (one not resident fails alone)."""
        failed: dict[str, str] = {}
        weights: dict[str, LoraWeights] = {}
        checked: list[list[ScheduledSeq]] = [[], []]
        for is_decode, seqs in ((False, plan.prefill), (True, plan.decode)):
            for seq in seqs:
                runs, error = seq, None
                if placeholders is not None:
                    runs, error = placeholders.substitute(seq, is_decode)
                error = error or limits.seq_error(seq, is_decode, input_known=runs is seq)
                ref = seq.lora
                if error is None and ref is not None and ref.name not in weights:
                    found = adapters(ref) if adapters is not None else None
                    if found is None:
                        error = not_loaded(ref.name)
                    else:
                        weights[ref.name] = found
                if error is None:
                    checked[is_decode].append(runs)
                else:
                    failed[seq.request_id] = error
        prefill, decode = checked
        decode.sort(key=lambda s: (not s.num_draft_tokens, -s.start_pos))
        null = plan.null_block_id
        return cls.from_seqs(prefill, decode, limits.block_size, null, failed, weights)

    @classmethod
    def from_seqs(
        cls,
        prefill: Sequence[ScheduledSeq],
        decode: Sequence[ScheduledSeq],
        block_size: int,
        null_block_id: int | None = None,
        failed: Mapping[str, str] | None = None,
        weights: Mapping[str, LoraWeights] | None = None,
    ) -> StepRows:
        """The rows of seqs already checked, in the order given; decodes with drafts must
        come first among ``decode``. ``weights``: the seqs' adapters by name (every one they
        name)."""
        num_verify = 0
        while num_verify < len(decode) and decode[num_verify].num_draft_tokens:
            num_verify += 1
        if any(s.num_draft_tokens for s in decode[num_verify:]):
            raise ValueError("decodes with drafts must come first")
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seqs = (*prefill, *decode)
        for seq in seqs:
            token_ids.extend(seq.token_ids)
            positions.extend(range(seq.start_pos, seq.end_pos))
            extend_slots(slots, seq.block_ids, seq.start_pos, seq.end_pos, block_size)
        window_slots: list[int] | None = None
        if seqs and seqs[0].window_block_ids is not None:
            window_slots = []
            for seq in seqs:
                assert seq.window_block_ids is not None, "every seq or none has window tables"
                extend_slots(
                    window_slots, seq.window_block_ids, seq.start_pos, seq.end_pos, block_size
                )
        return cls(
            tuple(prefill),
            tuple(decode),
            block_size,
            null_block_id,
            num_verify,
            token_ids,
            positions,
            slots,
            dict(failed or {}),
            LoraStep.of(prefill, decode, weights) if weights else None,
            window_slots,
        )

    @property
    def num_rows(self) -> int:
        return len(self.token_ids)

    @property
    def num_prefill_rows(self) -> int:
        return sum(s.num_tokens for s in self.prefill)

    @property
    def is_empty(self) -> bool:
        return not self.token_ids

    @property
    def chunks(self) -> tuple[ScheduledSeq, ...]:
        """Seqs of more than one query row over a cached prefix, in row order: the prefill
        chunks, then the decodes with drafts (verified as short chunks)."""
        return self.prefill + self.decode[: self.num_verify]

    @property
    def plain_decodes(self) -> tuple[ScheduledSeq, ...]:
        """The decodes without drafts (one row each), after ``chunks`` in row order."""
        return self.decode[self.num_verify :]

    @property
    def seqs(self) -> tuple[ScheduledSeq, ...]:
        return self.prefill + self.decode

    @property
    def has_adapters(self) -> bool:
        """Whether a row runs with a LoRA adapter (``ScheduledSeq.lora``)."""
        return any(s.lora is not None for s in self.seqs)

    @property
    def max_position(self) -> int:
        return max(self.positions, default=0)

    def block_tables(self) -> list[Sequence[int]]:
        """Each row's block table (its request's, shared by the request's rows)."""
        return [s.block_ids for s in self.seqs for _ in s.token_ids]

    def window_block_tables(self) -> list[Sequence[int]]:
        """Each row's table in the sliding layers' own pool (``window_slot_mapping``)."""
        return [s.window_block_ids or () for s in self.seqs for _ in s.token_ids]

    def sampled(self) -> list[ScheduledSeq]:
        """The seqs that sample, prefill first, in row order."""
        return [s for s in self.seqs if s.do_sample]

    def sample_rows(self) -> list[int]:
        """The rows whose logits are sampled, ascending: a sampling chunk's last row, every
        row of a sampling decode (k + 1 for one with drafts)."""
        rows: list[int] = []
        row = 0
        for s in self.prefill:
            row += s.num_tokens
            if s.do_sample:
                rows.append(row - 1)
        for s in self.decode:
            if s.do_sample:
                rows.extend(range(row, row + s.num_tokens))
            row += s.num_tokens
        return rows

    def split(self) -> tuple[StepRows, StepRows]:
        """The prefill rows and the decode rows as two steps (``fuse_batches=False``)."""
        bs, null = self.block_size, self.null_block_id
        weights = self.lora.weights if self.lora is not None else None
        return (
            StepRows.from_seqs(self.prefill, (), bs, null, weights=weights),
            StepRows.from_seqs((), self.decode, bs, null, weights=weights),
        )

    def one_row_decodes(self) -> list[ScheduledSeq]:
        """The decodes as one seq per row: a decode with k drafts as k + 1 one-token decodes
        at consecutive positions over its table (each attends up to its own position, and
        every row's K/V is written before any row attends)."""
        rows: list[ScheduledSeq] = []
        for s in self.decode:
            if not s.num_draft_tokens:
                rows.append(s)
                continue
            rows.extend(
                dataclasses.replace(s, token_ids=[t], start_pos=s.start_pos + i, num_draft_tokens=0)
                for i, t in enumerate(s.token_ids)
            )
        return rows


def extend_slots(
    slots: list[int], block_ids: Sequence[int], start: int, end: int, block_size: int
) -> None:
    """Append the flat slots of positions ``start .. end - 1``: one ``range`` per block."""
    pos = start
    while pos < end:
        block, offset = divmod(pos, block_size)
        n = min(block_size - offset, end - pos)
        base = block_ids[block] * block_size + offset
        slots.extend(range(base, base + n))
        pos += n


def verify_rows(seq: ScheduledSeq) -> list[ScheduledSeq]:
    """What the sampler sees at each of the k + 1 positions of a decode with drafts: row i
    samples output token ``num_output_tokens + i`` (min_tokens and a seeded draw key on it),
    with the i drafts before it as history (penalties), as if they had been generated."""
    drafts = seq.token_ids[1:]
    sampling = seq.sampling
    history = (
        sampling.repetition_penalty != 1.0
        or sampling.presence_penalty != 0.0
        or sampling.frequency_penalty != 0.0
    )
    return [
        dataclasses.replace(
            seq,
            token_ids=[token],
            start_pos=seq.start_pos + i,
            all_token_ids=[*seq.all_token_ids, *drafts[:i]] if history and i else seq.all_token_ids,
            num_output_tokens=seq.num_output_tokens + i,
            num_draft_tokens=0,
        )
        for i, token in enumerate(seq.token_ids)
    ]


def num_accepted_drafts(seq: ScheduledSeq, tokens: Sequence[int]) -> int:
    """How many drafts of ``seq`` are accepted, given the tokens sampled at its k + 1
    positions: the longest prefix of drafts equal to the tokens sampled before them.

    For greedy rows that is the longest matching prefix. For sampled rows it is rejection
    sampling with a point-mass draft q (the n-gram drafter proposes one token, q(d) = 1):
    the standard rule accepts d with probability min(1, p(d) / q(d)) = p(d) and otherwise
    draws from norm(max(0, p - q)), which is p without d, renormalised. Drawing x ~ p and
    accepting iff x == d has exactly that law, with x as the correction token. So every
    emitted token is distributed as the target model says, and a seeded request draws the
    same uniforms (keyed on its output index) and emits the same tokens as without drafts.
    """
    drafts = seq.token_ids[1:]
    num_accepted = 0
    while num_accepted < len(drafts) and tokens[num_accepted] == drafts[num_accepted]:
        num_accepted += 1
    return num_accepted
