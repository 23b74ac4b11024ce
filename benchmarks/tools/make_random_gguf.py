"""A GGUF with random weights in llama.cpp's converter layout, for benchmarks of models larger
than the one kvserve ships (nothing can be downloaded from a model hub here).

    python -m benchmarks.tools.make_random_gguf --out /tmp/llama-1b-f16.gguf     # 1B, F16
    python -m benchmarks.tools.make_random_gguf --out x.gguf --type Q4_K_M       # our quantizer
    python -m benchmarks.tools.make_random_gguf --out q.gguf --shape qwen3moe-30b-a3b-8l

The shape defaults to Llama-3.2-1B's (hidden 2048, 16 layers, 32 heads / 8 KV heads, MLP 8192,
tied embeddings); ``SHAPES`` holds the others: Llama-3.2-3B's, Qwen3-1.7B's (arch ``qwen3``:
QK-norm, head_dim 128 of its own, MLP 6144, tied), Qwen3-30B-A3B's layer scaled from 48
layers to 8 (arch ``qwen3moe``: 128 experts of 768, top 8, renormalized, every layer sparse, an
``output`` matrix of its own) and Gemma 3 1B's (arch ``gemma3``: 26 layers, 4 / 1 heads of 256,
MLP 6912, sliding window 512, the sandwich norms). The tokenizer and chat template are the
embedded SmolLM2's (vocabulary 49,152), so the same chat128 prompts run on each. Weights are
N(0, 0.02) (norms 1): the text it writes is noise, and only its speed means anything. ``--type
F16`` (the default) is what ``llama-quantize`` takes; ``--type Q4_K_M`` quantizes with
``benchmarks.tools.kquants`` instead.
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
# Qwen3's shapes: arch qwen3 (QK-norm; head_dim its own) or, with experts, qwen3moe.
SHAPE_QWEN3_1_7B = {"hidden": 2048, "layers": 28, "heads": 16, "kv_heads": 8, "head_dim": 128,
                    "intermediate": 6144, "qk_norm": 1}  # fmt: skip
SHAPE_QWEN3_30B_A3B_8L = {"hidden": 2048, "layers": 8, "heads": 32, "kv_heads": 4,
                          "head_dim": 128, "intermediate": 6144, "qk_norm": 1, "experts": 128,
                          "experts_used": 8, "expert_intermediate": 768, "output": 1}  # fmt: skip
# Gemma 3 1B's (arch gemma3: QK-norm, sandwich norms, GeGLU, 5 sliding layers of 512 to 1).
SHAPE_GEMMA3_1B = {"hidden": 1152, "layers": 26, "heads": 4, "kv_heads": 1, "head_dim": 256,
                   "intermediate": 6912, "qk_norm": 1, "sliding_window": 512}  # fmt: skip
# bench_models' random-<name>-q4km files
SHAPES = {"1b": SHAPE_1B, "3b": SHAPE_3B, "qwen3-1.7b": SHAPE_QWEN3_1_7B,
          "qwen3moe-30b-a3b-8l": SHAPE_QWEN3_30B_A3B_8L, "gemma3-1b": SHAPE_GEMMA3_1B}  # fmt: skip
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


def arch_of(shape: dict[str, int]) -> str:
    """The GGUF architecture a shape is written as: ``gemma3`` with a sliding window,
    ``qwen3moe`` with experts, ``qwen3`` with QK-norm, else ``llama``."""
    if shape.get("sliding_window"):
        return "gemma3"
    if shape.get("experts"):
        return "qwen3moe"
    return "qwen3" if shape.get("qk_norm") else "llama"


def write(out: Path, shape: dict[str, int], type_name: str = "F16", seed: int = 0) -> Path:
    """Write the model to ``out`` (F16 matrices, or ``type_name`` through ``kquants``)."""
    src = gguf.GGUFReader(default_model_path())
    arch = arch_of(shape)
    writer = gguf.GGUFWriter(str(out), arch)
    skip = {f"llama.{k}" for k in _SHAPE_KEYS} | {"general.architecture", "general.file_type"}
    for field in src.fields.values():
        if field.name in skip or field.name.startswith("GGUF.") or field.name == "general.name":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        name = field.name
        if arch != "llama" and name.startswith("llama."):  # rms epsilon: under the arch
            name = f"{arch}.{name.removeprefix('llama.')}"
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    hidden, layers, heads = shape["hidden"], shape["layers"], shape["heads"]
    kv_heads, inter = shape["kv_heads"], shape["intermediate"]
    head_dim = shape.get("head_dim", hidden // heads)
    experts = shape.get("experts", 0)
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    writer.add_name(f"random-{arch}-{hidden}x{layers}" + (f"-{experts}e" if experts else ""))
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != hidden // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if shape.get("sliding_window"):  # llama.cpp's gemma3: every 6th layer global, base 10000
        writer.add_sliding_window(shape["sliding_window"])
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(shape["experts_used"])
        writer.add_expert_feed_forward_length(shape["expert_intermediate"])
    writer.add_file_type(kquants.FILE_TYPES.get(type_name, 1))  # 1: mostly F16
    rng = np.random.default_rng(seed)
    has_output = bool(shape.get("output"))
    matrices: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, hidden)}
    if has_output:
        matrices["output.weight"] = (vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        matrices.update({
            p + "attn_q.weight": (heads * head_dim, hidden),
            p + "attn_k.weight": (kv_heads * head_dim, hidden),
            p + "attn_v.weight": (kv_heads * head_dim, hidden),
            p + "attn_output.weight": (hidden, heads * head_dim),
        })  # fmt: skip
        if experts:  # the converter's stacks: [E, rows, row length] in numpy order
            e_inter = shape["expert_intermediate"]
            matrices.update({
                p + "ffn_gate_exps.weight": (experts, e_inter, hidden),
                p + "ffn_up_exps.weight": (experts, e_inter, hidden),
                p + "ffn_down_exps.weight": (experts, hidden, e_inter),
            })  # fmt: skip
        else:
            matrices.update({
                p + "ffn_gate.weight": (inter, hidden),
                p + "ffn_up.weight": (inter, hidden),
                p + "ffn_down.weight": (hidden, inter),
            })  # fmt: skip
    for name, dims in matrices.items():
        values = (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float32)
        if type_name == "F16":
            writer.add_tensor(name, values.astype(np.float16))
        else:
            cols = dims[-1]
            kind = kquants.scheme_type(name, type_name, layers, cols, has_output=has_output)
            raw = kquants.quantize(values.reshape(-1, cols), kind)
            raw = raw.reshape(*dims[:-1], raw.shape[-1])
            writer.add_tensor(name, raw, raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
    # Norm weights 1 (Gemma's files hold 1 + w: there w = 0, the same scale).
    ones = np.ones(hidden, dtype=np.float32)
    writer.add_tensor("output_norm.weight", ones)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        if arch == "gemma3":  # the sandwich norms on the attention's and the MLP's outputs
            writer.add_tensor(f"blk.{i}.post_attention_norm.weight", ones)
            writer.add_tensor(f"blk.{i}.post_ffw_norm.weight", ones)
        if shape.get("qk_norm"):
            writer.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(head_dim, np.float32))
            writer.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(head_dim, np.float32))
        if experts:  # the router: F32, as the converter keeps it
            router = rng.standard_normal((experts, hidden), dtype=np.float32) * 0.02
            writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", router)
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
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b", help="SHAPES' entry")
    for key in SHAPE_1B:
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help="override")
    args = p.parse_args(argv)
    shape = dict(SHAPES[args.shape])
    shape.update({k: getattr(args, k) for k in SHAPE_1B if getattr(args, k) is not None})
    print(write(args.out, shape, args.type))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
