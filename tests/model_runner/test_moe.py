"""Mixture of experts: Qwen3-MoE (``Qwen3MoeForCausalLM``) and Mixtral (``MixtralForCausalLM``),
from their HF directories and from the GGUFs llama.cpp's converter writes (``qwen3moe``; a
``llama`` file with experts), against transformers; the step's rows grouped by expert."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from model_runner import kernels
from model_runner.config import ModelConfig, RunnerOptions
from model_runner.gguf_loader import permute_qk
from model_runner.hf_loader import load_hf_dir
from model_runner.loader import load_model
from model_runner.moe import MoeMlp
from model_runner.quant import QLinear, QuantWeight
from model_runner.runner import TorchRunner
from tests.model_runner.oracle import (
    native_gguf_runner,
    our_config,
    plan,
    random_ids,
    seq,
    tiny_hf,
)
from tests.model_runner.test_qwen3 import (
    _GLOBAL,
    _LAYER,
    NEW_TOKENS,
    PROMPTS,
    add_shape_keys,
    add_test_vocab,
    assert_top5_rule,
    engine_greedy,
    free_running,
    hf_greedy,
    runner_logits,
    write_hf_tensors,
)

# HF name (after ``model.layers.{i}.``) -> GGUF name (after ``blk.{i}.``) of an MoE layer, as
# llama.cpp's tensor map spells them: the router and the stacked experts.
_MOE_LAYER = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.gate_proj": "ffn_gate_exps.weight",
    "mlp.experts.up_proj": "ffn_up_exps.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
}
_QWEN3MOE_LAYER = {**_LAYER, **_MOE_LAYER}
_MIXTRAL_LAYER = {k: v for k, v in _QWEN3MOE_LAYER.items() if not k.endswith("q_norm.weight")
                  and not k.endswith("k_norm.weight")}  # fmt: skip


def converter_tensors(hf: torch.nn.Module, permute: bool) -> dict[str, torch.Tensor]:
    """``hf``'s tensors as the converter has them before naming them: each layer's experts
    stacked per projection (``mlp.experts.gate_proj`` [E, inter, hidden], ``up_proj``, and
    ``down_proj`` [E, hidden, inter]; transformers 5 holds gate and up as one stack) and, for
    a ``llama`` file (``permute``), Q and K rows permuted as ``LlamaModel.permute`` does."""
    c = hf.config
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf.state_dict().items():
        t = tensor.detach().cpu()
        if name.endswith("mlp.experts.gate_up_proj"):
            head = name.removesuffix("gate_up_proj")
            out[head + "gate_proj"], out[head + "up_proj"] = t.chunk(2, dim=1)
            continue
        if permute and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            t = torch.from_numpy(permute_qk(t.numpy(), heads))
        out[name] = t
    return out


def write_moe_gguf(hf: torch.nn.Module, path: Path, qtype: Any = "F32") -> Path:
    """``hf`` as convert_hf_to_gguf.py writes it: a Qwen3-MoE as arch ``qwen3moe`` (Qwen3's
    keys, ``expert_feed_forward_length`` = moe_intermediate_size, Q/K unpermuted), a Mixtral
    as arch ``llama`` (Q/K permuted, ``feed_forward_length`` = the experts' size); both with
    ``expert_count`` / ``expert_used_count``, the router F32 and the experts stacked."""
    c = hf.config
    qwen = c.model_type == "qwen3_moe"
    writer = gguf.GGUFWriter(str(path), arch="qwen3moe" if qwen else "llama")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    add_shape_keys(writer, c)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_expert_count(c.num_local_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    if qwen:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    else:
        writer.add_vocab_size(c.vocab_size)
    writer.add_file_type(_FILE_TYPES[qtype if isinstance(qtype, str) else "Q4_K_M"])
    add_test_vocab(writer, c.vocab_size)
    layer = _QWEN3MOE_LAYER if qwen else _MIXTRAL_LAYER
    write_hf_tensors(writer, hf, layer, _GLOBAL, qtype, converter_tensors(hf, permute=not qwen))
    return path


# llama.cpp's LlamaFileType of each file this test writes.
_FILE_TYPES = {"F32": 0, "Q8_0": 7, "Q4_K_M": 15}


def q4_k_m(gguf_name: str) -> str:
    """Q4_K_M's mix, as llama.cpp's quantizer makes it for a small model: Q6_K for the LM
    head, V and the down projections (the experts' too), Q4_K for the other matrices."""
    six = ("output.weight", "attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")
    return "Q6_K" if gguf_name.endswith(six) else "Q4_K"


KINDS = {
    "qwen3moe": {},  # 8 experts of 32, top-2, renormalized, every layer sparse
    "mixtral": {},  # 4 experts of 128, top-2
    # 4 layers, experts on layer 1 only: decoder_sparse_step 2 makes 1 and 3 sparse,
    # mlp_only_layers takes 3 back; layers 0, 2 and 3 keep the dense MLP.
    "qwen3moe-dense-layers": {
        "num_hidden_layers": 4,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    },
}
LAYERS = {"qwen3moe": (0, 1), "mixtral": (0, 1), "qwen3moe-dense-layers": (1,)}


def _model(kind: str) -> torch.nn.Module:
    return tiny_hf(kind.removesuffix("-dense-layers"), seed=11, **KINDS[kind])


@pytest.fixture(scope="module", params=list(KINDS))
def case(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module, list[list[int]]]:
    hf = _model(request.param)
    return request.param, hf, [hf_greedy(hf, p) for p in PROMPTS]


def _assert_served(config: ModelConfig, state: dict[str, Any], want: list[list[int]]) -> None:
    """The engine's greedy ids (prefix caching on, 32-token prefill chunks, the 40-token
    prompt sent again and served from the cache) equal ``want``."""
    got, requests = engine_greedy(config, state, repeat_first=True)
    assert requests[-1].num_cached_tokens >= 32
    assert got[:4] == want and got[4] == want[3]


def test_hf_directory_serves_transformers_greedy(
    case: tuple[str, torch.nn.Module, list[list[int]]], tmp_path: Path
) -> None:
    """From the directory save_pretrained writes (one tensor per expert; Mixtral's under
    ``block_sparse_moe``): the experts and their layers read from config.json, and 4
    prompts' greedy ids equal transformers', a cached and chunked prompt's too."""
    kind, hf, want = case
    hf.save_pretrained(tmp_path / kind)
    config, state = load_hf_dir(tmp_path / kind)
    assert config.experts is not None and config.experts.layers == LAYERS[kind]
    e = LAYERS[kind][0]
    assert f"model.layers.{e}.mlp.experts.1.down_proj.weight" in state
    assert not any("block_sparse_moe" in name for name in state)
    _assert_served(config, dict(state), want)


def test_converter_layout_gguf_serves_transformers_greedy(
    case: tuple[str, torch.nn.Module, list[list[int]]], tmp_path: Path
) -> None:
    """From an F32 GGUF in the converter's layout (router ``ffn_gate_inp``, experts stacked
    in ``ffn_*_exps``; a dense layer's ``ffn_gate`` / ``ffn_up`` / ``ffn_down``): each
    expert's matrix is transformers' exactly, and the greedy ids equal transformers'."""
    kind, hf, want = case
    loaded = load_model(write_moe_gguf(hf, tmp_path / f"{kind}.gguf"))
    config = loaded.config
    assert config.architecture == kind.removesuffix("-dense-layers")
    assert config.experts is not None and config.experts.layers == LAYERS[kind]
    e = LAYERS[kind][0]
    stack = hf.state_dict()[f"model.layers.{e}.mlp.experts.down_proj"].cpu()
    got = loaded.state_dict[f"model.layers.{e}.mlp.experts.2.down_proj.weight"]
    torch.testing.assert_close(got, stack[2], rtol=0, atol=0)
    _assert_served(config, dict(loaded.state_dict), want)


def test_unnormalized_router_from_config(tmp_path: Path) -> None:
    """Qwen3-MoE with ``norm_topk_prob`` false (transformers' default): the chosen experts
    keep their softmax weights, and the greedy ids equal transformers'; renormalizing them
    would answer otherwise on these weights."""
    hf = tiny_hf("qwen3moe", seed=12, norm_topk_prob=False)
    want = [hf_greedy(hf, p) for p in PROMPTS]
    config = our_config(hf)
    assert config.experts is not None and not config.experts.norm_topk_prob
    state = {k: v.detach().cpu() for k, v in hf.state_dict().items()}
    got, _ = engine_greedy(config, state)
    assert got == want
    renormalized = ModelConfig(**{**_fields(config), "experts": _renormalized(config)})
    assert engine_greedy(renormalized, state)[0] != want


def _fields(config: ModelConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in ModelConfig.__dataclass_fields__}


def _renormalized(config: ModelConfig) -> Any:
    from dataclasses import replace

    assert config.experts is not None
    return replace(config.experts, norm_topk_prob=True)


class _Inputs:
    """A ``MoeMlp`` that records its inputs."""

    def __init__(self, inner: MoeMlp, inputs: list[torch.Tensor]) -> None:
        self.inner, self.inputs = inner, inputs

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        self.inputs.append(x.clone())
        return self.inner.add(x, residual)


class _Counting:
    """A layer that records the rows it is called on."""

    def __init__(self, inner: Any, calls: list[int]) -> None:
        self.inner, self.calls = inner, calls

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[0])
        return self.inner.silu_mul(x)

    def tensors(self) -> list[torch.Tensor]:
        return list(self.inner.tensors())


def test_each_chosen_expert_runs_once_per_step_on_all_its_rows() -> None:
    """One 23-row prefill step: each expert the router chose for some row runs exactly once,
    on as many rows as chose it, and no other expert runs."""
    hf = tiny_hf("qwen3moe", seed=13)
    runner = TorchRunner(
        our_config(hf),
        {k: v.detach().cpu() for k, v in hf.state_dict().items()},
        RunnerOptions(16, 16, dtype=torch.float32, device="cpu", kv_dtype="float32"),
    )
    moe = runner.model.layers[0].moe
    assert isinstance(moe, MoeMlp)
    calls: list[list[int]] = [[] for _ in moe.gate_up]
    moe.gate_up = [_Counting(layer, calls[e]) for e, layer in enumerate(moe.gate_up)]
    inputs: list[torch.Tensor] = []
    runner.model.layers[0].moe = _Inputs(moe, inputs)  # type: ignore[assignment]
    ids = random_ids(23, seed=5)
    runner.step_logits(plan(0, prefill=[seq("a", ids, 0, len(ids), [0, 1])]))
    (x,) = inputs
    chosen, _ = moe.route(x)
    counts = torch.bincount(chosen.flatten(), minlength=len(calls)).tolist()
    assert calls == [[n] if n else [] for n in counts]
    assert sum(counts) == 23 * 2 and sum(1 for n in counts if n) >= 2


def test_missing_expert_is_named(tmp_path: Path) -> None:
    """A Mixtral state dict without one expert's down projection fails naming it."""
    hf = tiny_hf("mixtral", seed=14)
    hf.save_pretrained(tmp_path / "m")
    config, state = load_hf_dir(tmp_path / "m")
    del state["model.layers.1.mlp.experts.3.down_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks 1 weights .*layers\.1\.mlp\.experts\.3\.down"):
        TorchRunner(config, state, RunnerOptions(8, 16, dtype=torch.float32, device="cpu"))


ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.mark.parametrize("kind", list(KINDS))
def test_peft_adapter_on_a_moe_models_attention_gives_transformers_peft_logits(
    kind: str, tmp_path: Path
) -> None:
    """A random PEFT adapter on Q, K, V and O of every layer (Qwen3-MoE's dense layers too):
    every position's logits equal transformers + PEFT's within 1e-4, and differ from the
    base's by far more. (PEFT on transformers 5 turns an MLP target of such a model into its
    experts' stacks, ``target_parameters``: refused, below.)"""
    from tests.model_runner.lora_oracle import peft_adapter
    from tests.model_runner.oracle import assert_close, hf_logits, make_runner
    from tests.model_runner.test_lora import logits_with

    hf = _model(kind)
    reference = peft_adapter(hf, tmp_path / "a", targets=ATTENTION)
    runner = make_runner(hf)
    info = runner.lora.load("a", tmp_path / "a")
    assert len(info.target_modules) == 4
    ids = random_ids(13, seed=1)
    ours = logits_with(runner, ids, runner.lora.resolve("a"))
    assert_close(ours, hf_logits(reference, ids))
    base = logits_with(runner, ids, None)
    assert (ours - base).abs().max() > 0.1


def test_lora_on_experts_or_the_router_is_refused_in_one_line(tmp_path: Path) -> None:
    """An adapter on Qwen3-MoE's router (PEFT's ``mlp.gate``) is refused at load in one line
    naming experts; so is an MLP pair (``gate_proj``, from a dense twin) on a layer that is a
    mixture of experts."""
    from model_runner.lora.info import AdapterError
    from tests.model_runner.lora_oracle import peft_adapter

    hf = tiny_hf("qwen3moe", seed=16)
    peft_adapter(hf, tmp_path / "router", targets=["q_proj", "gate"])
    twin = tiny_hf("qwen3", seed=16)
    peft_adapter(twin, tmp_path / "dense", targets=["q_proj", "gate_proj"])
    runner = TorchRunner(
        our_config(hf),
        {k: v.detach().cpu() for k, v in hf.state_dict().items()},
        RunnerOptions(8, 16, dtype=torch.float32, device="cpu", kv_dtype="float32"),
    )
    for name, says in (
        ("router", "LoRA on a mixture-of-experts layer's experts or router is not supported"),
        ("dense", "updates layer 0's gate_proj, but that layer of the qwen3moe base is a "
                  "mixture of experts"),
    ):  # fmt: skip
        with pytest.raises(AdapterError) as info:
            runner.lora.load(name, tmp_path / name)
        message = str(info.value)
        assert "\n" not in message and says in message and "q_proj, k_proj" in message


def test_moe_layers_off_the_cpu_are_refused_in_one_line() -> None:
    """The expert grouping reads the routing on the host: an MoE layer on another device
    (here ``meta``; CUDA alike) is refused naming it, not run."""
    from model_runner.families import Experts

    experts = Experts(num_experts=2, num_used=1, intermediate_size=4, norm_topk_prob=True,
                      layers=(0,))  # fmt: skip
    with pytest.raises(ValueError, match=r"mixture-of-experts layers run on CPU only, not meta"):
        MoeMlp(torch.zeros(2, 8, device="meta"), [], [], experts)


# ---------------------------------------------------------------- quantized experts

QTYPES: dict[str, Any] = {"Q8_0": "Q8_0", "Q4_K_M": q4_k_m}


def wide_moe(kind: str) -> torch.nn.Module:
    """A 256-wide ``kind`` (Qwen3-MoE: 4 experts of 256, head_dim 128; Mixtral: 4 experts of
    256), for the quantized files."""
    wide: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 256}
    if kind.startswith("qwen3moe"):
        wide.update(num_experts=4, moe_intermediate_size=256, intermediate_size=512, head_dim=128)
    return tiny_hf(kind.removesuffix("-dense-layers"), seed=15, **KINDS[kind], **wide)


def quantized_moe(kind: str, qtype: str, tmp_path: Path) -> Path:
    """``wide_moe(kind)`` in a ``qtype`` GGUF in the converter's layout: every expert one
    quantized matrix of its stack, the router F32."""
    return write_moe_gguf(wide_moe(kind), tmp_path / f"{kind}-{qtype}.gguf", QTYPES[qtype])


@pytest.mark.slow
@pytest.mark.skipif(not kernels.available(), reason="kernels not built")
@pytest.mark.parametrize("kind", ["qwen3moe", "mixtral"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M"])
def test_quantized_gguf_is_logprobs_close_to_transformers(
    kind: str, qtype: str, tmp_path: Path
) -> None:
    """A Q8_0 / Q4_K_M file's experts held in their formats, each expert's gate-up and down a
    kernels' ``QLinear``: vLLM's check_logprobs_close on 4 prompts x 12 tokens against
    transformers holding the file's weights (where greedy first differs, each side's token
    is in the other's top-5)."""
    from benchmarks.tools.reference import build_hf_model

    path = quantized_moe(kind, qtype, tmp_path)
    loaded, runner = native_gguf_runner(path)
    held = loaded.state_dict["model.layers.1.mlp.experts.3.down_proj.weight"]
    assert isinstance(held, QuantWeight) and held.fmt == ("Q8_0" if qtype == "Q8_0" else "Q6_K")
    assert not isinstance(loaded.state_dict["model.layers.1.mlp.gate.weight"], QuantWeight)
    moe = runner.model.layers[1].moe
    assert moe is not None and all(isinstance(m, QLinear) for m in (*moe.gate_up, *moe.down))
    assert runner.paths.fused is not None  # the whole-step kernel runs its experts
    dense = load_model(path, weights="float32")
    twin = build_hf_model(dense.config, dict(dense.state_dict), with_eos=False)  # type: ignore[arg-type]
    assert_top5_rule(runner, twin, PROMPTS)


@pytest.mark.slow
@pytest.mark.skipif(not kernels.available(), reason="kernels not built")
@pytest.mark.parametrize("kind", ["qwen3moe", "mixtral"])
def test_quantized_chunked_and_cached_equals_one_shot(kind: str, tmp_path: Path) -> None:
    """On Q4_K_M experts, the engine's run (32-token prefill chunks, the 40-token prompt sent
    again and served from the prefix cache) gives the greedy ids of each prompt prefilled
    whole in a fresh runner, token for token."""
    loaded, runner = native_gguf_runner(quantized_moe(kind, "Q4_K_M", tmp_path))
    want = [free_running(runner_logits(runner), p, NEW_TOKENS)[0] for p in PROMPTS]
    got, requests = engine_greedy(
        loaded.config, dict(loaded.state_dict), repeat_first=True, kv_dtype="float32"
    )
    assert requests[-1].num_cached_tokens >= 32
    assert got == [*want, want[3]]


@pytest.mark.slow
@pytest.mark.skipif(not kernels.available(), reason="kernels not built")
@pytest.mark.parametrize("kind", ["qwen3moe", "mixtral"])
def test_int8_experts_from_hf_directory_are_logprobs_close(kind: str, tmp_path: Path) -> None:
    """``--weights int8`` (``quant.quantize_matrices``, as the loader applies it) on an HF
    directory: every expert's matrices int8 per row on the kernels, the router left fp32;
    vLLM's top-5 rule against transformers holding the int8 weights (dequantized)."""
    from benchmarks.tools.reference import build_hf_model
    from model_runner.quant import quantize_matrices

    hf = tiny_hf(kind, seed=17)
    hf.save_pretrained(tmp_path / kind)
    config, dense = load_hf_dir(tmp_path / kind)
    state = quantize_matrices(dense)
    held = state["model.layers.0.mlp.experts.1.up_proj.weight"]
    assert isinstance(held, QuantWeight) and held.source == "int8"
    assert not isinstance(state["model.layers.0.mlp.gate.weight"], QuantWeight)
    options = RunnerOptions(8, 16, dtype=torch.float32, device="cpu", kv_dtype="float32")
    runner = TorchRunner(config, state, options)
    moe = runner.model.layers[0].moe
    assert moe is not None and all(isinstance(m, QLinear) for m in (*moe.gate_up, *moe.down))
    held_weights = {
        k: v.dequantize() if isinstance(v, QuantWeight) else v for k, v in state.items()
    }
    twin = build_hf_model(config, held_weights, with_eos=False)
    assert_top5_rule(runner, twin, PROMPTS)


@pytest.mark.skipif(not kernels.available(), reason="kernels not built")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("isa", list(reversed(kernels.ISAS)))
@pytest.mark.parametrize("kind", list(KINDS))
def test_fused_step_runs_the_experts_as_the_torch_path(
    kind: str, isa: str, threads: int, tmp_path: Path
) -> None:
    """A Q4_K_M file's experts in the kernels' whole-step call (``moe_mlp``: the router, each
    row's top-k, the rows grouped by expert, each chosen expert once over its rows) give the
    torch path's logits (``MoeMlp`` layer by layer on the same ``QLinear`` experts): a step of
    three prefill chunks, then four decode steps of three rows that share experts, each one
    kernel call; Qwen3-MoE's dense layers in the same call. The paths differ in the router's
    and attention's fp32 summation order only: within 5e-2 of max|logit| (an int8 activation
    boundary, as test_quant's fused test), and the same greedy token every step; on each ISA
    family this CPU runs, with the team of one thread and of two (the experts' sums split by
    columns)."""

    from tests.model_runner.oracle import assert_fused_step_equals_torch, isa_and_threads

    with isa_and_threads(isa, threads):
        assert_fused_step_equals_torch(quantized_moe(kind, "Q4_K_M", tmp_path))


@pytest.mark.skipif(not kernels.available(), reason="kernels not built")
@pytest.mark.parametrize("kind", ["qwen3moe", "mixtral"])
def test_fused_step_with_adapters_on_a_moe_models_attention_equals_the_torch_path(
    kind: str, tmp_path: Path
) -> None:
    """A Q4_K_M MoE file with a PEFT adapter on Q, K, V and O: a step of an adapter's prefill
    chunk beside the base model's, then decodes, through the fused kernel (the adapter's
    updates before the experts) and the torch path with the same fp16 adapter values (the
    kernels hold adapters in fp16; that rounding alone flips a near-tied expert of this tiny
    Mixtral against fp32 ones): logits within 5e-2 of max|logit| (as the fused step without
    adapters), the update far larger than that."""
    from tests.model_runner.lora_oracle import peft_adapter, with_lora
    from tests.model_runner.test_quant import assert_close

    class Fp16Adapters(TorchRunner):  # the torch path holding adapters as the kernels do
        @property
        def lora_dtype(self) -> torch.dtype:
            return torch.float16

    path = quantized_moe(kind, "Q4_K_M", tmp_path)
    loaded = load_model(path, weights="native")
    runners = [
        kind_of(loaded.config, loaded.state_dict,
                RunnerOptions(16, 16, dtype=torch.float32, device="cpu",
                              kv_dtype="float32", fused_step=fused))
        for kind_of, fused in ((TorchRunner, True), (Fp16Adapters, False))
    ]  # fmt: skip
    assert runners[0].paths.fused is not None and runners[1].paths.fused is None
    peft_adapter(wide_moe(kind), tmp_path / "a", targets=ATTENTION)
    for runner in runners:
        runner.lora.load("a", tmp_path / "a")
    ref = runners[0].lora.resolve("a")
    prompts = {"a": random_ids(9, seed=31), "base": random_ids(14, seed=32)}
    tables = {"a": [0, 1], "base": [2, 3]}
    refs = {"a": ref, "base": None}
    step = plan(0, prefill=[with_lora(seq(n, ids, 0, len(ids), tables[n]), refs[n])
                            for n, ids in prompts.items()])  # fmt: skip
    for i in range(3):
        got, want = (runner.step_logits(step) for runner in runners)
        for n in prompts:
            assert_close(got[n], want[n], 5e-2)
            prompts[n] = [*prompts[n], int(want[n][-1].argmax())]
        step = plan(1 + i, decode=[with_lora(seq(n, ids, len(ids) - 1, len(ids), tables[n]),
                                             refs[n]) for n, ids in prompts.items()])  # fmt: skip
    ids = prompts["a"]
    bare = plan(9, prefill=[seq("b", ids, 0, len(ids), [4, 5])])
    lora = plan(9, prefill=[with_lora(seq("c", ids, 0, len(ids), [6, 7]), ref)])
    base, updated = runners[0].step_logits(bare)["b"], runners[0].step_logits(lora)["c"]
    assert (updated - base).abs().max() > 0.1 * updated.abs().max()


@pytest.mark.skipif(not kernels.available(), reason="kernels not built")
@pytest.mark.parametrize("prompt_lens", [(5, 19, 33), (70, 9)])
@pytest.mark.parametrize("kind", ["qwen3moe", "mixtral"])
def test_fused_experts_give_the_same_bits_on_one_thread_and_two(
    kind: str, prompt_lens: tuple[int, ...], tmp_path: Path
) -> None:
    """The kernels' MoE layer at two threads splits each chosen expert's matrices between
    the threads and sums the experts' outputs by columns, in ascending expert order: every
    logit is the same bits as at one thread (a row's numbers never depend on the team): a
    prefill step of 57 rows (114 row-expert pairs) or of 79 (158), then three decode steps."""
    from tests.model_runner.oracle import isa_and_threads

    loaded = load_model(quantized_moe(kind, "Q4_K_M", tmp_path), weights="native")
    prompts = {f"r{i}": random_ids(n, seed=30 + i) for i, n in enumerate(prompt_lens)}
    tables = {r: list(range(8 * i, 8 * i + 8)) for i, r in enumerate(prompts)}
    logits: dict[int, list[dict[str, torch.Tensor]]] = {}
    for threads in (1, 2):
        options = RunnerOptions(8 * len(prompts), 16, dtype=torch.float32, device="cpu",
                                kv_dtype="float32", fused_step=True)  # fmt: skip
        runner = TorchRunner(loaded.config, loaded.state_dict, options)
        assert runner.paths.fused is not None
        ids = {r: list(p) for r, p in prompts.items()}
        step = plan(0, prefill=[seq(r, p, 0, len(p), tables[r]) for r, p in ids.items()])
        logits[threads] = []
        with isa_and_threads(kernels.isa(), threads):
            for i in range(4):
                logits[threads].append(runner.step_logits(step))
                for r in ids:
                    ids[r].append(int(logits[threads][-1][r][-1].argmax()))
                rows = [seq(r, p, len(p) - 1, len(p), tables[r]) for r, p in ids.items()]
                step = plan(1 + i, decode=rows)
    for one, two in zip(logits[1], logits[2], strict=True):
        for r in prompts:
            assert torch.equal(one[r], two[r]), r
