"""Write the seed inputs of each fuzz target into ``fuzz/corpus/<target>/`` (valid examples
for the fuzzer to mutate): ``python -m fuzz.seeds``. Files are named by content hash, as
libFuzzer names its own, so running it twice changes nothing."""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

from server.rpc import generation_pb2 as pb

CORPUS = Path(__file__).resolve().parent / "corpus"

_CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
COMPLETION_BODIES: list[dict[str, Any]] = [
    {"model": "fake", "prompt": "hello", "max_tokens": 6, "temperature": 0},
    {"prompt": [72, 105], "max_tokens": 5, "stream": True,
     "stream_options": {"include_usage": True}},
    {"prompt": ["two"], "n": 2, "seed": 7, "top_k": 3, "top_p": 0.5, "min_p": 0.1},
    {"prompt": "x", "stop": ["\n", "END"], "stop_token_ids": [5], "ignore_eos": True},
    {"prompt": "x", "logprobs": 2, "presence_penalty": 0.5, "frequency_penalty": -0.5,
     "repetition_penalty": 1.1, "min_tokens": 1, "priority": -3, "cache_salt": "t1", "user": "u"},
    {"prompt": "x", "echo": False, "best_of": 1, "suffix": None, "logit_bias": {}},
]  # fmt: skip
CHAT_BODIES: list[dict[str, Any]] = [
    {"model": "fake", "messages": _CHAT, "max_completion_tokens": 4},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}], "stream": True},
    {"messages": _CHAT, "logprobs": True, "top_logprobs": 3, "stop": "!", "seed": 1},
    {"messages": [{"role": "assistant", "content": None}, {"role": "tool", "content": "t"}]},
]


def generate_requests() -> list[pb.GenerateRequest]:
    r = pb.GenerateRequest
    return [
        r(text="hello", request_id="a", priority=-1, cache_salt="s"),
        r(token_ids=pb.TokenIds(ids=[1, 2, 3]), n=2),
        r(
            chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]),
            sampling=pb.SamplingOptions(temperature=0.5, top_k=4, top_p=0.9, seed=3, logprobs=2),
            stopping=pb.StoppingOptions(max_tokens=8, min_tokens=1, stop=["\n"], ignore_eos=True),
        ),
        r(text="x", slo=pb.LatencyTargets(ttft_ms=100.0, itl_ms=20.0)),
    ]


DETOKENIZER_INPUTS = [
    b"\x00" + "hello 中😀 world".encode(),
    # two stop strings ("STOP", "😀"), push size 3
    bytes([0b10100]) + b"\x04STOP\x04" + "😀".encode() + "a STOP b 😀".encode(),
    b"\x02\x01!" + b"abc!def\xff\x01tail\xff\x00",  # stop "!", an EOS, an escaped 0xFF
    b"\x01" + bytes(range(40)),  # window tokenizer
    b"\x0b\x01l" + bytes(range(0, 60, 3)),  # window tokenizer, stop "l", push size 2
]


def gguf_file(with_tensors: bool = True, head_count: int = 2) -> bytes:
    """A llama header with every key the loader reads and (``with_tensors``) tiny tensors."""
    import gguf
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "seed.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_embedding_length(8)
        w.add_feed_forward_length(16)
        w.add_block_count(1)
        w.add_head_count(head_count)
        w.add_head_count_kv(1)
        w.add_context_length(64)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_rope_freq_base(10000.0)
        w.add_tokenizer_model("gpt2")
        w.add_token_list(["a", "b", "c", "d"])
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
        if with_tensors:
            w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
            w.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path.read_bytes()


# One body per route of ``fuzz.targets.ROUTES`` (by its index there).
ROUTE_BODIES: list[tuple[int, dict[str, Any]]] = [
    (0, {"model": "fake", "input": "hi", "max_output_tokens": 4, "stream": True}),
    (0, {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
         "text": {"format": {"type": "json_object"}}}),
    (1, {"model": "fake", "max_tokens": 4, "system": "be brief",
         "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
    (2, {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}),
    (3, {"prompt": "hello", "add_special_tokens": False}),
    (3, {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}),
    (4, {"tokens": [1, 2, 3]}),
]  # fmt: skip


def seeds() -> dict[str, list[bytes]]:
    return {
        "openai_parser": [b"\x00" + json.dumps(b).encode() for b in COMPLETION_BODIES]
        + [b"\x01" + json.dumps(b).encode() for b in CHAT_BODIES]
        + [bytes([0x80 + 2 * i]) + json.dumps(b).encode() for i, b in ROUTE_BODIES],
        "request_validation": [r.SerializeToString() for r in generate_requests()],
        "detokenizer": DETOKENIZER_INPUTS,
        "gguf_header": [gguf_file(with_tensors=True), gguf_file(with_tensors=False)],
    }


def main() -> None:
    for target, inputs in seeds().items():
        folder = CORPUS / target
        folder.mkdir(parents=True, exist_ok=True)
        for data in inputs:
            (folder / hashlib.sha1(data).hexdigest()).write_bytes(data)
        print(f"{target}: {len(inputs)} seeds in {folder}")


if __name__ == "__main__":
    main()
