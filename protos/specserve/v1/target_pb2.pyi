from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TargetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetInfo(_message.Message):
    __slots__ = ("model_type", "vocab_size", "vocab_hash", "max_context", "num_layers", "hidden_size", "eos_token_ids", "tensor_parallel_size", "model_name", "hidden_share_kind", "host_id", "runs_loop")
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_HASH_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SHARE_KIND_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    RUNS_LOOP_FIELD_NUMBER: _ClassVar[int]
    model_type: str
    vocab_size: int
    vocab_hash: str
    max_context: int
    num_layers: int
    hidden_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tensor_parallel_size: int
    model_name: str
    hidden_share_kind: str
    host_id: str
    runs_loop: bool
    def __init__(self, model_type: _Optional[str] = ..., vocab_size: _Optional[int] = ..., vocab_hash: _Optional[str] = ..., max_context: _Optional[int] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., tensor_parallel_size: _Optional[int] = ..., model_name: _Optional[str] = ..., hidden_share_kind: _Optional[str] = ..., host_id: _Optional[str] = ..., runs_loop: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "sampling", "hidden_layers", "want_shm", "want_hidden_share", "logprobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    WANT_SHM_FIELD_NUMBER: _ClassVar[int]
    WANT_HIDDEN_SHARE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    hidden_layers: _containers.RepeatedScalarFieldContainer[int]
    want_shm: bool
    want_hidden_share: bool
    logprobs: _common_pb2.LogprobsSpec
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., hidden_layers: _Optional[_Iterable[int]] = ..., want_shm: _Optional[bool] = ..., want_hidden_share: _Optional[bool] = ..., logprobs: _Optional[_Union[_common_pb2.LogprobsSpec, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("session_id", "next_token", "hidden", "timings", "shm_channel", "hidden_share", "hidden_rows", "logprobs", "prompt_logprobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    SHM_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SHARE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_ROWS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    next_token: int
    hidden: _common_pb2.Tensor
    timings: _common_pb2.StepTimings
    shm_channel: str
    hidden_share: _common_pb2.HiddenShare
    hidden_rows: _common_pb2.HiddenRows
    logprobs: _common_pb2.TokenLogprobs
    prompt_logprobs: _common_pb2.TokenLogprobs
    def __init__(self, session_id: _Optional[str] = ..., next_token: _Optional[int] = ..., hidden: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.StepTimings, _Mapping]] = ..., shm_channel: _Optional[str] = ..., hidden_share: _Optional[_Union[_common_pb2.HiddenShare, _Mapping]] = ..., hidden_rows: _Optional[_Union[_common_pb2.HiddenRows, _Mapping]] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "draft", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    draft: _common_pb2.DraftBlock
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, session_id: _Optional[str] = ..., draft: _Optional[_Union[_common_pb2.DraftBlock, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("session_id", "accepted_ids", "next_token", "hidden", "num_drafted", "experts_touched", "timings", "batch_size", "hidden_rows", "logprobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_IDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_TOUCHED_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_ROWS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    accepted_ids: _containers.RepeatedScalarFieldContainer[int]
    next_token: int
    hidden: _common_pb2.Tensor
    num_drafted: int
    experts_touched: int
    timings: _common_pb2.StepTimings
    batch_size: int
    hidden_rows: _common_pb2.HiddenRows
    logprobs: _common_pb2.TokenLogprobs
    def __init__(self, session_id: _Optional[str] = ..., accepted_ids: _Optional[_Iterable[int]] = ..., next_token: _Optional[int] = ..., hidden: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., num_drafted: _Optional[int] = ..., experts_touched: _Optional[int] = ..., timings: _Optional[_Union[_common_pb2.StepTimings, _Mapping]] = ..., batch_size: _Optional[int] = ..., hidden_rows: _Optional[_Union[_common_pb2.HiddenRows, _Mapping]] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class TargetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetStats(_message.Message):
    __slots__ = ("active_sessions", "kv_blocks_total", "kv_blocks_used", "steps", "shm_steps", "shm_channels", "hidden_rows_shared", "hidden_rows_as_bytes", "hidden_buffers")
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SHM_STEPS_FIELD_NUMBER: _ClassVar[int]
    SHM_CHANNELS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_ROWS_SHARED_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_ROWS_AS_BYTES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    active_sessions: int
    kv_blocks_total: int
    kv_blocks_used: int
    steps: int
    shm_steps: int
    shm_channels: int
    hidden_rows_shared: int
    hidden_rows_as_bytes: int
    hidden_buffers: int
    def __init__(self, active_sessions: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., steps: _Optional[int] = ..., shm_steps: _Optional[int] = ..., shm_channels: _Optional[int] = ..., hidden_rows_shared: _Optional[int] = ..., hidden_rows_as_bytes: _Optional[int] = ..., hidden_buffers: _Optional[int] = ...) -> None: ...

class RunRequest(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "max_new_tokens", "sampling", "num_speculative_tokens", "tree_nodes", "tree_top_k", "tree_depth", "adaptive", "draft_ahead", "trust_draft_probs", "logprobs", "model_name", "draft_address", "draft_name", "draft_step_timeout_s", "reserve_tokens", "draft_breaker_failures", "draft_probe_every_s", "no_draft_shm", "no_hidden_share")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    TREE_TOP_K_FIELD_NUMBER: _ClassVar[int]
    TREE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_FIELD_NUMBER: _ClassVar[int]
    TRUST_DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NAME_FIELD_NUMBER: _ClassVar[int]
    DRAFT_STEP_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BREAKER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBE_EVERY_S_FIELD_NUMBER: _ClassVar[int]
    NO_DRAFT_SHM_FIELD_NUMBER: _ClassVar[int]
    NO_HIDDEN_SHARE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: _common_pb2.SamplingParams
    num_speculative_tokens: int
    tree_nodes: int
    tree_top_k: int
    tree_depth: int
    adaptive: bool
    draft_ahead: bool
    trust_draft_probs: bool
    logprobs: _common_pb2.LogprobsSpec
    model_name: str
    draft_address: str
    draft_name: str
    draft_step_timeout_s: float
    reserve_tokens: int
    draft_breaker_failures: int
    draft_probe_every_s: float
    no_draft_shm: bool
    no_hidden_share: bool
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., num_speculative_tokens: _Optional[int] = ..., tree_nodes: _Optional[int] = ..., tree_top_k: _Optional[int] = ..., tree_depth: _Optional[int] = ..., adaptive: _Optional[bool] = ..., draft_ahead: _Optional[bool] = ..., trust_draft_probs: _Optional[bool] = ..., logprobs: _Optional[_Union[_common_pb2.LogprobsSpec, _Mapping]] = ..., model_name: _Optional[str] = ..., draft_address: _Optional[str] = ..., draft_name: _Optional[str] = ..., draft_step_timeout_s: _Optional[float] = ..., reserve_tokens: _Optional[int] = ..., draft_breaker_failures: _Optional[int] = ..., draft_probe_every_s: _Optional[float] = ..., no_draft_shm: _Optional[bool] = ..., no_hidden_share: _Optional[bool] = ...) -> None: ...

class RunTokens(_message.Message):
    __slots__ = ("token_ids", "logprobs", "prompt_logprobs", "drafted", "accepted", "verify_compute_ms", "draft_compute_ms", "step", "verify_ms", "experts_touched", "context_len", "draft_ms", "verify_wall_ms", "draft_service_ms")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_TOUCHED_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_WALL_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SERVICE_MS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _common_pb2.TokenLogprobs
    prompt_logprobs: _common_pb2.TokenLogprobs
    drafted: int
    accepted: int
    verify_compute_ms: float
    draft_compute_ms: float
    step: bool
    verify_ms: float
    experts_touched: int
    context_len: int
    draft_ms: float
    verify_wall_ms: float
    draft_service_ms: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., verify_compute_ms: _Optional[float] = ..., draft_compute_ms: _Optional[float] = ..., step: _Optional[bool] = ..., verify_ms: _Optional[float] = ..., experts_touched: _Optional[int] = ..., context_len: _Optional[int] = ..., draft_ms: _Optional[float] = ..., verify_wall_ms: _Optional[float] = ..., draft_service_ms: _Optional[float] = ...) -> None: ...

class RunFinal(_message.Message):
    __slots__ = ("finish_reason", "prompt_tokens", "completion_tokens", "stats")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: _common_pb2.SpecStats
    def __init__(self, finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., stats: _Optional[_Union[_common_pb2.SpecStats, _Mapping]] = ...) -> None: ...

class RunEvent(_message.Message):
    __slots__ = ("tokens", "final")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    tokens: RunTokens
    final: RunFinal
    def __init__(self, tokens: _Optional[_Union[RunTokens, _Mapping]] = ..., final: _Optional[_Union[RunFinal, _Mapping]] = ...) -> None: ...
