"""Request validation: SamplingParams owns the ranges; the edge names the request's fields."""

from __future__ import annotations

import pytest

from server.rpc import generation_pb2 as pb
from server.validation import InvalidRequestError, Limits, sampling_params

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
