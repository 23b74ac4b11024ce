"""Request validation: SamplingParams owns the ranges; the edge names the request's fields."""

from __future__ import annotations

import dataclasses

import pytest

from server.rpc import generation_pb2 as pb
from server.validation import (
    InvalidRequestError,
    Limits,
    check_stopping_fields,
    sampling_params,
)

LIMITS = Limits(vocab_size=258, max_model_len=128, max_n=4)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (
            pb.GenerateRequest(sampling=pb.SamplingOptions(temperature=-1)),
            "sampling.temperature must be >= 0 (0 = greedy), got -1",
        ),
        (
            pb.GenerateRequest(sampling=pb.SamplingOptions(top_p=1.5)),
            "sampling.top_p must be in (0, 1], got 1.5",
        ),
        (
            pb.GenerateRequest(stopping=pb.StoppingOptions(max_tokens=4, min_tokens=9)),
            "stopping.min_tokens must be in [0, max_tokens=4], got 9",
        ),
        (
            pb.GenerateRequest(stopping=pb.StoppingOptions(stop=["ok", ""])),
            "stopping.stop[1] is empty: stop strings need text",
        ),
        (pb.GenerateRequest(n=0), "n must be >= 1, got 0"),
    ],
)
def test_sampling_params_errors_name_the_request_field(
    request_: pb.GenerateRequest, message: str
) -> None:
    """The message is SamplingParams' own, with the field renamed to its path in the request."""
    with pytest.raises(InvalidRequestError) as exc:
        sampling_params(request_, num_prompt_tokens=5, limits=LIMITS)
    assert str(exc.value) == message


def test_max_tokens_past_the_context_only_with_attention_sinks() -> None:
    """Without sinks max_tokens past the context is INVALID_ARGUMENT with the allowed range
    and how to get more; a server with sinks accepts it (the prompt must still fit)."""
    request = pb.GenerateRequest(stopping=pb.StoppingOptions(max_tokens=300))
    with pytest.raises(InvalidRequestError) as exc:
        check_stopping_fields(request.stopping, LIMITS)
    assert "beyond the model's context of 128 tokens" in str(exc.value)
    request = pb.GenerateRequest(stopping=pb.StoppingOptions(max_tokens=100))
    with pytest.raises(InvalidRequestError) as exc:
        sampling_params(request, num_prompt_tokens=40, limits=LIMITS)
    assert str(exc.value) == (
        "stopping.max_tokens = 100 is beyond the context: the prompt has 40 tokens and the "
        "model's context is 128, so max_tokens must be in [1, 88] (only a server started with "
        "--attention-sinks and --sliding-window generates past the context)"
    )
    sinks = dataclasses.replace(LIMITS, streams_past_context=True)
    check_stopping_fields(pb.StoppingOptions(max_tokens=300), sinks)
    long = pb.GenerateRequest(stopping=pb.StoppingOptions(max_tokens=300))
    assert sampling_params(long, num_prompt_tokens=40, limits=sinks).max_tokens == 300
    with pytest.raises(InvalidRequestError, match="the prompt has 128 tokens"):
        sampling_params(long, num_prompt_tokens=128, limits=sinks)


def test_constraint_of_each_oneof_case() -> None:
    """The constraint oneof becomes a Constraint (choice as a JSON list); unset is None;
    an empty or false value and an oversized spec are refused with the field's name."""
    from scheduler.request import Constraint
    from server.validation import MAX_CONSTRAINT_BYTES, InvalidRequestError, constraint_of

    def req(**fields: object) -> pb.GenerateRequest:
        return pb.GenerateRequest(text="x", **fields)  # type: ignore[arg-type]

    assert constraint_of(req()) is None
    assert constraint_of(req(regex="a+")) == Constraint("regex", "a+")
    assert constraint_of(req(json_schema="{}")) == Constraint("json_schema", "{}")
    assert constraint_of(req(json_object=True)) == Constraint("json_object")
    assert constraint_of(req(grammar="start: /a/")) == Constraint("grammar", "start: /a/")
    choice = req(choice=pb.ChoiceList(choices=["a", "b"]))
    assert constraint_of(choice) == Constraint("choice", '["a", "b"]')
    for bad, message in (
        (req(json_object=False), "json_object must be true"),
        (req(regex=""), "regex must not be empty"),
        (req(choice=pb.ChoiceList(choices=["a", ""])), "choice.choices must hold"),
        (req(grammar="x" * (MAX_CONSTRAINT_BYTES + 1)), f"at most {MAX_CONSTRAINT_BYTES}"),
    ):
        with pytest.raises(InvalidRequestError, match=message):
            constraint_of(bad)
