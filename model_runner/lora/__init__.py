"""LoRA adapters over the base model: many adapters, chosen per request, rows of different
adapters (and of the base model) in one step.

    files.py     PEFT directories and GGUF LoRA files -> AdapterFile (Hugging Face layout)
    layout.py    checked against the base model, laid out as kvserve's model holds weights
    registry.py  the adapters a runner serves: load / unload, an LRU budget, pins
    step.py      one step's rows by adapter; the grouped products of the torch path
    native.py    the same for the fused CPU kernels (kernels/lora.h)
    triton_ops.py  SGMV (prefill segments) and BGMV (decode rows) on CUDA
    info.py      what the rest of kvserve reads without torch: errors, AdapterInfo

The scheduler's side (``scheduler.lora``: ``max_loras``) and the fronts' (``server.lora``,
``server.openai.lora``) see adapters by name, as ``scheduler.request.LoraRef``.
"""
