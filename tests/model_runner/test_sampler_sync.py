"""The sampler's device phase never makes the host wait for the device, and a runner that
runs a step ahead takes its placeholder tokens where it computes.

On CPU every op is synchronous, so the check is on the code path: ``NoHostSync`` (a
``TorchFunctionMode``) raises on every call that would read a device value back on a GPU
(``item``, ``tolist``, ``cpu``, ``nonzero``, boolean-mask indexing, ``multinomial``...). On
CUDA (run by ``benchmarks.tools.gpu_check``) torch's own sync debug mode raises on any
synchronisation while the batch is prepared and sampled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from model_runner.config import RunnerOptions
from model_runner.future import FutureTokens, Placeholders
from model_runner.sampler import Sampler
from scheduler.output import PLACEHOLDER_TOKEN_ID, ScheduledSeq
from scheduler.request import SamplingParams
from tests.model_runner.test_sampler import make_seq

GREEDY = SamplingParams(temperature=0.0)

# Calls that wait for the device (or copy a device value to the host) on a GPU.
_SYNCING = {
    "item",
    "tolist",
    "cpu",
    "numpy",
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
    "unique_consecutive",
    "multinomial",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__complex__",
    "equal",
    "allclose",
}


class HostSyncError(AssertionError):
    """A call that synchronises with the device ran where none may."""


def _has_bool_index(args: Any) -> bool:
    if isinstance(args, torch.Tensor):
        return args.dtype == torch.bool
    if isinstance(args, (tuple, list)):
        return any(_has_bool_index(a) for a in args)
    return False


class NoHostSync(TorchFunctionMode):
    """Raises ``HostSyncError`` on any torch call that would synchronise on a GPU."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = getattr(func, "__name__", "")
        if name in _SYNCING:
            raise HostSyncError(f"{name} synchronises with the device")
        if name in ("__getitem__", "__setitem__", "index_put_", "index_put") and _has_bool_index(
            args[1:2]
        ):
            raise HostSyncError(f"{name} with a boolean mask synchronises with the device")
        if name == "repeat_interleave" and (kwargs or {}).get("output_size") is None:
            raise HostSyncError("repeat_interleave without output_size synchronises")
        if name == "where" and len(args) == 1:
            raise HostSyncError("where(condition) synchronises with the device")
        return func(*args, **(kwargs or {}))


def every_stage() -> tuple[torch.Tensor, list[ScheduledSeq]]:
    """A batch that runs every stage: greedy and sampled rows, seeded and not, top-k, top-p,
    min-p, all three penalties, min_tokens, logprobs, a NaN row, and a placeholder (as the
    runner substitutes it: row 1 of the step in flight, ``_resolve``'s index 1)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 300, generator=gen)
    logits[5, 7] = float("nan")
    params = [
        GREEDY,
        SamplingParams(temperature=0.8, top_k=20, seed=4, logprobs=3),
        SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.2, top_k=50, top_p=0.7, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.2, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, min_tokens=4, stop_token_ids=(9,)),
        SamplingParams(temperature=0.9, repetition_penalty=1.5, seed=8),
    ]
    seqs = [
        make_seq(f"r{i}", p, prompt=[1, 2, 3], output=[4, 5][: i % 3], eos_token_ids=(2,))
        for i, p in enumerate(params)
    ]
    seqs[7].token_ids = [FutureTokens.encode(1)]
    seqs[7].num_output_tokens += 1
    return logits, seqs


def _resolve(future: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def resolve(ids: torch.Tensor) -> torch.Tensor:
        return torch.where(ids < 0, future[(-ids - 1).clamp(min=0)], ids)

    return resolve


def test_the_guard_catches_a_sync() -> None:
    """NoHostSync raises on item(), tolist() and boolean-mask indexing (the check can fail)."""
    x = torch.arange(4)
    for call in (lambda: x[0].item(), x.tolist, lambda: x[x > 1], lambda: bool(x[0])):
        with NoHostSync(), pytest.raises(HostSyncError):
            call()


def test_launch_makes_no_host_sync() -> None:
    """The device phase of a batch running every stage makes no synchronising call; its
    result then equals the one-call ``sample`` of the same batch."""
    logits, seqs = every_stage()
    sampler = Sampler(seed=0)
    batch = sampler.prepare(
        seqs, logits.device, logits.shape[1], history_id=Placeholders.history_id
    )
    resolve = _resolve(torch.tensor([0, 11]))
    with NoHostSync():
        sample = sampler.launch(logits, batch, resolve)
    result = sampler.collect(batch, sample)
    assert list(result.failed) == ["r5"]
    assert result.token_ids[0] == int(logits[0].argmax())
    assert result.logprobs[1] is not None and len(result.logprobs[1].top) == 3


def test_greedy_batch_takes_one_host_copy() -> None:
    """Three greedy rows: the tokens and the bad-row flags come back in one tensor, read with
    one ``tolist``."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0], [0.0, 1.0, 2.0]])
    sampler = Sampler()
    seqs = [make_seq(f"r{i}", GREEDY) for i in range(3)]
    batch = sampler.prepare(seqs, logits.device, 3)
    sample = sampler.launch(logits, batch)
    assert sample.logprobs is None and sample.top_ids is None
    calls: list[int] = []
    original = torch.Tensor.tolist

    def counting(self: torch.Tensor) -> object:
        calls.append(1)
        return original(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "tolist", counting)
        result = sampler.collect(batch, sample)
    assert result.token_ids == [1, 0, 2]
    assert len(calls) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sampling_makes_no_synchronisation() -> None:
    """On CUDA, preparing and launching a batch that runs every stage makes no
    synchronisation (torch's sync debug mode raises on one), and its greedy tokens and
    failed rows equal the CPU's."""
    logits, seqs = every_stage()
    device = torch.device("cuda")
    sampler = Sampler(seed=0)
    on_gpu = logits.to(device)
    future = torch.tensor([0, 11], device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = sampler.prepare(seqs, device, logits.shape[1], history_id=Placeholders.history_id)
        sample = sampler.launch(on_gpu, batch, _resolve(future))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got = sampler.collect(batch, sample.map(lambda t: t.cpu()))
    cpu = Sampler(seed=0)
    cpu_batch = cpu.prepare(
        seqs, logits.device, logits.shape[1], history_id=Placeholders.history_id
    )
    want = cpu.collect(cpu_batch, cpu.launch(logits, cpu_batch, _resolve(torch.tensor([0, 11]))))
    assert got.failed.keys() == want.failed.keys()
    for i in (0, 4):  # the greedy rows
        assert got.token_ids[i] == want.token_ids[i], i


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
def test_a_runner_running_ahead_gives_the_synchronous_tokens(device: str) -> None:
    """Two requests, a prefill then two decodes, each decode submitted before the step that
    samples its input is read (its token a placeholder, resolved from the previous step's
    sampled ids on the device): the tokens equal those of the same steps run one at a time,
    on a CPU step thread and on CUDA (through the decode graphs when the backend has them)."""
    from model_runner.runner import TorchRunner
    from tests.model_runner.oracle import GREEDY, our_config, plan, random_ids, seq, tiny_hf

    hf = tiny_hf("llama-gqa", seed=3)
    state = {k: v.detach().cpu() for k, v in hf.state_dict().items()}
    prompts = {"a": random_ids(6, seed=1), "b": random_ids(9, seed=2)}
    tables = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8, 9]}

    def make() -> TorchRunner:
        options = RunnerOptions(
            num_blocks=16, block_size=4, dtype=torch.float32, device=device, kv_dtype="float32"
        )
        return TorchRunner(our_config(hf), state, options)

    def decode(rid: str, known: list[int], ahead: bool) -> ScheduledSeq:
        prompt = prompts[rid]
        return ScheduledSeq(
            rid,
            [PLACEHOLDER_TOKEN_ID] if ahead else [known[-1]],
            len(known) - (0 if ahead else 1),
            tables[rid],
            GREEDY,
            True,
            list(known),
            len(prompt),
            len(known) - len(prompt) + ahead,
        )

    prefill = plan(0, prefill=[seq(r, p, 0, len(p), tables[r]) for r, p in prompts.items()])
    sync = make()
    known = {r: list(p) for r, p in prompts.items()}
    for step in range(3):
        todo = (
            prefill if step == 0 else plan(step, decode=[decode(r, known[r], False) for r in known])
        )
        for rid, token in sync.execute(todo).sampled_token_ids.items():
            known[rid].append(token)

    ahead = make()
    ahead.use_step_thread(device == "cpu")
    assert ahead.can_run_ahead
    mine = {r: list(p) for r, p in prompts.items()}
    first = ahead.submit(prefill)
    second = ahead.submit(plan(1, decode=[decode(r, mine[r], True) for r in mine]))
    for rid, token in first.result().sampled_token_ids.items():
        mine[rid].append(token)
    third = ahead.submit(plan(2, decode=[decode(r, mine[r], True) for r in mine]))
    for handle in (second, third):
        result = handle.result()
        assert not result.failed, result.failed
        for rid, token in result.sampled_token_ids.items():
            mine[rid].append(token)
    ahead.use_step_thread(False)
    assert mine == known
