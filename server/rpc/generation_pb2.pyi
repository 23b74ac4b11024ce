from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: str
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[str] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "tools", "chat_template_kwargs")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    tools: str
    chat_template_kwargs: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., tools: _Optional[str] = ..., chat_template_kwargs: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingOptions(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "logprobs", "prompt_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    logprobs: int
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class StoppingOptions(_message.Message):
    __slots__ = ("max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "chat", "sampling", "stopping", "request_id", "priority", "cache_salt", "n", "slo", "adapter", "adapter_scale", "json_schema", "json_object", "regex", "choice", "grammar")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_SCALE_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    sampling: SamplingOptions
    stopping: StoppingOptions
    request_id: str
    priority: int
    cache_salt: str
    n: int
    slo: LatencyTargets
    adapter: str
    adapter_scale: float
    json_schema: str
    json_object: bool
    regex: str
    choice: ChoiceList
    grammar: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., stopping: _Optional[_Union[StoppingOptions, _Mapping]] = ..., request_id: _Optional[str] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., n: _Optional[int] = ..., slo: _Optional[_Union[LatencyTargets, _Mapping]] = ..., adapter: _Optional[str] = ..., adapter_scale: _Optional[float] = ..., json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class LatencyTargets(_message.Message):
    __slots__ = ("ttft_ms", "itl_ms")
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_MS_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: float
    itl_ms: float
    def __init__(self, ttft_ms: _Optional[float] = ..., itl_ms: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("sampled", "top")
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    sampled: TokenLogprob
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, sampled: _Optional[_Union[TokenLogprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_time_s", "time_to_first_token_s", "e2e_time_s")
    QUEUE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    E2E_TIME_S_FIELD_NUMBER: _ClassVar[int]
    queue_time_s: float
    time_to_first_token_s: float
    e2e_time_s: float
    def __init__(self, queue_time_s: _Optional[float] = ..., time_to_first_token_s: _Optional[float] = ..., e2e_time_s: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "index", "token_ids", "text", "logprobs", "finished", "finish_reason", "stop_reason", "usage", "timings", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finished: bool
    finish_reason: FinishReason
    stop_reason: str
    usage: Usage
    timings: Timings
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "chat", "add_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatMessages
    add_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "max_context_length", "vocab_size", "kv_block_size", "kv_num_blocks", "dtype", "device", "eos_token_ids", "kv_memory_bytes", "weights", "weight_bytes", "adapters")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_context_length: int
    vocab_size: int
    kv_block_size: int
    kv_num_blocks: int
    dtype: str
    device: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_memory_bytes: int
    weights: str
    weight_bytes: int
    adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    def __init__(self, model: _Optional[str] = ..., max_context_length: _Optional[int] = ..., vocab_size: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., kv_num_blocks: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., kv_memory_bytes: _Optional[int] = ..., weights: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., adapters: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "rank", "alpha", "target_modules", "format", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    rank: int
    alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    format: str
    digest: str
    def __init__(self, name: _Optional[str] = ..., rank: _Optional[int] = ..., alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ..., format: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class GetKVCacheStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVCacheStats(_message.Message):
    __slots__ = ("total_sequences", "total_memory_bytes", "average_sequence_length", "cache_hit_rate", "cache_efficiency", "block_size", "num_blocks_total", "num_blocks_used", "num_blocks_cached_free", "num_blocks_free", "total_tokens", "used_memory_bytes", "usage", "prefix_queries_tokens_total", "prefix_hits_tokens_total", "evictions_total", "cow_copies_total", "preemptions_total", "num_blocks_reserved", "block_bytes", "kv_strategy", "strategy_dropped_tokens_total", "strategy_windowed_tokens_total", "tier2_hit_blocks_total", "tier2_hit_tokens_total", "tier2_spill_blocks_total", "tier2", "sliding_blocks_total", "sliding_blocks_used", "sliding_blocks_released_total")
    TOTAL_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    AVERAGE_SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    CACHE_EFFICIENCY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_CACHED_FREE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    USED_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIES_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    COW_COPIES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_RESERVED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_STRATEGY_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_DROPPED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_WINDOWED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TIER2_HIT_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TIER2_HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TIER2_SPILL_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TIER2_FIELD_NUMBER: _ClassVar[int]
    SLIDING_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SLIDING_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    SLIDING_BLOCKS_RELEASED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    total_sequences: int
    total_memory_bytes: int
    average_sequence_length: float
    cache_hit_rate: float
    cache_efficiency: float
    block_size: int
    num_blocks_total: int
    num_blocks_used: int
    num_blocks_cached_free: int
    num_blocks_free: int
    total_tokens: int
    used_memory_bytes: int
    usage: float
    prefix_queries_tokens_total: int
    prefix_hits_tokens_total: int
    evictions_total: int
    cow_copies_total: int
    preemptions_total: int
    num_blocks_reserved: int
    block_bytes: int
    kv_strategy: str
    strategy_dropped_tokens_total: int
    strategy_windowed_tokens_total: int
    tier2_hit_blocks_total: int
    tier2_hit_tokens_total: int
    tier2_spill_blocks_total: int
    tier2: KVTierStats
    sliding_blocks_total: int
    sliding_blocks_used: int
    sliding_blocks_released_total: int
    def __init__(self, total_sequences: _Optional[int] = ..., total_memory_bytes: _Optional[int] = ..., average_sequence_length: _Optional[float] = ..., cache_hit_rate: _Optional[float] = ..., cache_efficiency: _Optional[float] = ..., block_size: _Optional[int] = ..., num_blocks_total: _Optional[int] = ..., num_blocks_used: _Optional[int] = ..., num_blocks_cached_free: _Optional[int] = ..., num_blocks_free: _Optional[int] = ..., total_tokens: _Optional[int] = ..., used_memory_bytes: _Optional[int] = ..., usage: _Optional[float] = ..., prefix_queries_tokens_total: _Optional[int] = ..., prefix_hits_tokens_total: _Optional[int] = ..., evictions_total: _Optional[int] = ..., cow_copies_total: _Optional[int] = ..., preemptions_total: _Optional[int] = ..., num_blocks_reserved: _Optional[int] = ..., block_bytes: _Optional[int] = ..., kv_strategy: _Optional[str] = ..., strategy_dropped_tokens_total: _Optional[int] = ..., strategy_windowed_tokens_total: _Optional[int] = ..., tier2_hit_blocks_total: _Optional[int] = ..., tier2_hit_tokens_total: _Optional[int] = ..., tier2_spill_blocks_total: _Optional[int] = ..., tier2: _Optional[_Union[KVTierStats, _Mapping]] = ..., sliding_blocks_total: _Optional[int] = ..., sliding_blocks_used: _Optional[int] = ..., sliding_blocks_released_total: _Optional[int] = ...) -> None: ...

class KVTierStats(_message.Message):
    __slots__ = ("backend", "capacity_bytes", "num_blocks", "num_bytes", "spill_blocks_total", "spill_bytes_total", "spill_seconds_total", "restore_blocks_total", "restore_bytes_total", "restore_seconds_total", "lookups_blocks_total", "errors_total")
    class ErrorsTotalEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPILL_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPILL_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPILL_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RESTORE_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RESTORE_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RESTORE_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ERRORS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    backend: str
    capacity_bytes: int
    num_blocks: int
    num_bytes: int
    spill_blocks_total: int
    spill_bytes_total: int
    spill_seconds_total: float
    restore_blocks_total: int
    restore_bytes_total: int
    restore_seconds_total: float
    lookups_blocks_total: int
    errors_total: _containers.ScalarMap[str, int]
    def __init__(self, backend: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., spill_blocks_total: _Optional[int] = ..., spill_bytes_total: _Optional[int] = ..., spill_seconds_total: _Optional[float] = ..., restore_blocks_total: _Optional[int] = ..., restore_bytes_total: _Optional[int] = ..., restore_seconds_total: _Optional[float] = ..., lookups_blocks_total: _Optional[int] = ..., errors_total: _Optional[_Mapping[str, int]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...
