"""A LLaMA-shaped GGUF with random weights, for benchmarks of models larger than the one kvserve
ships (nothing can be downloaded from a model hub here).

    python -m benchmarks.tools.make_random_gguf --out /tmp/llama-1b-f16.gguf     # 1B, F16
    python -m benchmarks.tools.make_random_gguf --out x.gguf --type Q4_K_M       # our quantizer

The shape defaults to Llama-3.2-1B's (hidden 2048, 16 layers, 32 heads / 8 KV heads, MLP 8192,
tied embeddings); the tokenizer and chat template are the embedded SmolLM2's (vocabulary 49,152),
so the same chat128 prompts run on it. Weights are N(0, 0.02) (norms 1): the text it writes is
noise, and only its speed means anything. ``--type F16`` (the default) is what
``llama-quantize`` takes; ``--type Q4_K_M`` quantizes with ``benchmarks.tools.kquants`` instead.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

from benchmarks.tools import kquants
from model_runner.gguf_loader import default_model_path

SHAPE_1B = {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "intermediate": 8192}
SHAPE_3B = {"hidden": 3072, "layers": 28, "heads": 24, "kv_heads": 8, "intermediate": 8192}
SHAPES = {"1b": SHAPE_1B, "3b": SHAPE_3B}  # bench_models' random-<size>-q4km files
# Keys of the embedded file that describe its shape: replaced, not copied.
_SHAPE_KEYS = (
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "rope.dimension_count",
)


def write(out: Path, shape: dict[str, int], type_name: str = "F16", seed: int = 0) -> Path:
    """Write the model to ``out`` (F16 matrices, or ``type_name`` through ``kquants``)."""
    src = gguf.GGUFReader(default_model_path())
    writer = gguf.GGUFWriter(str(out), "llama")
    skip = {f"llama.{k}" for k in _SHAPE_KEYS} | {"general.architecture", "general.file_type"}
    for field in src.fields.values():
        if field.name in skip or field.name.startswith("GGUF.") or field.name == "general.name":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    hidden, layers, heads = shape["hidden"], shape["layers"], shape["heads"]
    kv_heads, inter = shape["kv_heads"], shape["intermediate"]
    head_dim = hidden // heads
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    writer.add_name(f"random-llama-{hidden}x{layers}")
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(kquants.FILE_TYPES.get(type_name, 1))  # 1: mostly F16
    rng = np.random.default_rng(seed)
    matrices = {"token_embd.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"blk.{i}."
        matrices.update({
            p + "attn_q.weight": (hidden, hidden),
            p + "attn_k.weight": (kv_heads * head_dim, hidden),
            p + "attn_v.weight": (kv_heads * head_dim, hidden),
            p + "attn_output.weight": (hidden, hidden),
            p + "ffn_gate.weight": (inter, hidden),
            p + "ffn_up.weight": (inter, hidden),
            p + "ffn_down.weight": (hidden, inter),
        })  # fmt: skip
    for name, (rows, cols) in matrices.items():
        values = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)
        if type_name == "F16":
            writer.add_tensor(name, values.astype(np.float16))
        else:
            kind = kquants.scheme_type(name, type_name, layers, cols, has_output=False)
            raw = kquants.quantize(values, kind)
            writer.add_tensor(name, raw, raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
    ones = np.ones(hidden, dtype=np.float32)
    writer.add_tensor("output_norm.weight", ones)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.tools.make_random_gguf", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--type", default="F16", choices=["F16", "Q4_K_M", "Q8_0", "Q4_0"])
    for key, value in SHAPE_1B.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=value)
    args = p.parse_args(argv)
    shape = {key: getattr(args, key) for key in SHAPE_1B}
    print(write(args.out, shape, args.type))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
