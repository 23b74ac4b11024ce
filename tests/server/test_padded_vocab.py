"""A model whose embedding has more rows than its tokenizer has entries (Qwen2.5's, Phi-3's)
serves: an id past the tokenizer's entries streams as empty text, not an INTERNAL error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_runner.config import RunnerOptions
from model_runner.loader import load_model
from model_runner.runner import TorchRunner
from server.rpc import generation_pb2 as pb
from tests.model_runner.test_gguf_loader import load_gguf_checkpoint, write_tiny_gguf
from tests.server.helpers import collect, serve

TOKENS, ROWS = 40, 48  # tokenizer entries, embedding rows


def padded_hf_dir(tmp_path: Path) -> Path:
    """A tiny Llama directory with 48 embedding rows over a 40-token tokenizer, whose LM head
    makes a padded id (44 or 45) the greedy choice at every step: only rows 44 and 45 have
    weight, on the one hidden dimension the final norm keeps, with opposite signs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from model_runner.tokenizer import Tokenizer

    torch.manual_seed(0)
    hf = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=ROWS,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            eos_token_id=2,
            bos_token_id=1,
            tie_word_embeddings=False,
        )
    )
    with torch.no_grad():
        hf.model.norm.weight.zero_()[0] = 1.0
        hf.lm_head.weight.zero_()
        hf.lm_head.weight[44, 0], hf.lm_head.weight[45, 0] = 50.0, -50.0
    model_dir = tmp_path / "padded"
    hf.save_pretrained(model_dir)
    m = write_tiny_gguf(tmp_path / "tok.gguf")  # its tokenizer: 40 entries t0 .. t39
    tokenizer = Tokenizer.from_gguf_metadata(load_gguf_checkpoint(m.path).metadata)
    assert tokenizer.vocab_size == TOKENS
    tokenizer.backend.save(str(model_dir / "tokenizer.json"))
    return model_dir


@pytest.mark.slow
async def test_padded_ids_stream_as_empty_text(tmp_path: Path) -> None:
    """Greedy over a padded vocabulary samples ids 44/45 (past the 40 tokens): the request
    finishes by length with those ids and empty text, and the server keeps serving."""
    loaded = load_model(str(padded_hf_dir(tmp_path)))
    assert (loaded.config.vocab_size, loaded.tokenizer.vocab_size) == (ROWS, TOKENS)
    options = RunnerOptions(16, 4, dtype=torch.float32, device="cpu", kv_dtype="float32")
    runner = TorchRunner(loaded.config, loaded.state_dict, options)
    async with serve(runner, loaded.tokenizer) as h:
        for rid in ("a", "b"):
            msgs = await collect(
                h.client.generate(
                    [5, 6, 7], request_id=rid, max_tokens=4, temperature=0.0, ignore_eos=True
                )
            )
            ids = [t for m in msgs for t in m.token_ids]
            assert len(ids) == 4 and set(ids) <= {44, 45}
            assert "".join(m.text for m in msgs) == ""
            assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
