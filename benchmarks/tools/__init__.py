"""Tools the tests and benchmarks use, none of them product code: ``gpu_check`` (the GPU
machine's one command), ``make_random_gguf`` and ``make_random_lora`` (model and adapter
files with random weights), ``kquants`` (the K-quant writer), ``reference`` (the
transformers twin of a kvserve model)."""
