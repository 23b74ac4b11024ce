"""A Phi-3 GGUF as a user brings one, served end to end: the converter's tensor layout, a
SentencePiece vocabulary (``tokenizer.ggml.model = llama``) shorter than the embedding (Phi-3
pads 32011 tokens to 32064 rows), Phi-3's chat template in ``tokenizer.chat_template``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import torch

from model_runner.config import RunnerOptions
from model_runner.loader import load_model
from model_runner.runner import TorchRunner
from server.rpc import generation_pb2 as pb
from tests.model_runner.test_phi3 import LONG_ORIGINAL, hf_greedy, longrope_phi3, write_phi3_gguf
from tests.model_runner.test_spm_tokenizer import VOCAB, trained, vocab_writer  # noqa: F401
from tests.server.helpers import collect, serve

PHI3_TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "chat_templates" / "phi3.jinja"
ROWS = VOCAB + 32  # padded past the tokenizer, as Phi-3's embedding is


async def test_phi3_gguf_serves_a_chat_as_transformers_answers(
    trained: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A chat request to a Phi-4-mini-shaped GGUF (partial rotary, longrope; the prompt past
    the original context of 16, so both sides use the long factors) with its own vocabulary
    and template: the prompt is the template's text in the file's tokens, the 12 greedy ids
    equal transformers' on those ids, and the text ends in their decoding."""
    hf = longrope_phi3(LONG_ORIGINAL, seed=7, vocab_size=ROWS)
    spm_vocab = vocab_writer(trained)

    def vocab(writer: gguf.GGUFWriter) -> None:
        spm_vocab(writer)
        writer.add_chat_template(PHI3_TEMPLATE.read_text(encoding="utf-8"))

    loaded = load_model(write_phi3_gguf(hf, tmp_path / "phi3.gguf", vocab=vocab))
    tokenizer = loaded.tokenizer
    assert (loaded.config.vocab_size, tokenizer.vocab_size) == (ROWS, VOCAB)
    messages = [{"role": "user", "content": "Hello world, tiny tokenizer"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert text == "<|user|>\nHello world, tiny tokenizer<|end|>\n<|assistant|>\n"
    prompt = tokenizer.encode(text, add_special_tokens=False)  # as chat prompts are (vLLM)
    want = hf_greedy(hf, prompt)
    options = RunnerOptions(32, 4, dtype=torch.float32, device="cpu", kv_dtype="float32")
    runner = TorchRunner(loaded.config, loaded.state_dict, options)
    async with serve(runner, tokenizer) as h:
        msgs = await collect(
            h.client.generate(chat=messages, max_tokens=12, temperature=0.0, ignore_eos=True)
        )
    ids = [t for m in msgs for t in m.token_ids]
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert msgs[-1].usage.prompt_tokens == len(prompt)
    assert ids == want
    # Past the first 4 tokens only: the random model samples lone byte tokens first, which a
    # whole decode turns into U+FFFD as a group (tokenizers' ByteFallback) where the stream
    # had already sent the one valid byte among them.
    assert "".join(m.text for m in msgs).endswith(tokenizer.decode(ids[4:]))
