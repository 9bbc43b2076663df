from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftInfo(_message.Message):
    __slots__ = ("family", "vocab_size", "vocab_hash", "max_block_size", "needs_hidden_states", "hidden_layers", "has_probs", "supports_tree", "hidden_share_kinds", "host_id")
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_HASH_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NEEDS_HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HAS_PROBS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_TREE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SHARE_KINDS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    family: str
    vocab_size: int
    vocab_hash: str
    max_block_size: int
    needs_hidden_states: bool
    hidden_layers: _containers.RepeatedScalarFieldContainer[int]
    has_probs: bool
    supports_tree: bool
    hidden_share_kinds: _containers.RepeatedScalarFieldContainer[str]
    host_id: str
    def __init__(self, family: _Optional[str] = ..., vocab_size: _Optional[int] = ..., vocab_hash: _Optional[str] = ..., max_block_size: _Optional[int] = ..., needs_hidden_states: _Optional[bool] = ..., hidden_layers: _Optional[_Iterable[int]] = ..., has_probs: _Optional[bool] = ..., supports_tree: _Optional[bool] = ..., hidden_share_kinds: _Optional[_Iterable[str]] = ..., host_id: _Optional[str] = ...) -> None: ...

class StartSessionRequest(_message.Message):
    __slots__ = ("session_id", "token_ids", "hidden", "sampling", "want_shm", "hidden_share", "hidden_rows")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    WANT_SHM_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SHARE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_ROWS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    hidden: _common_pb2.Tensor
    sampling: _common_pb2.SamplingParams
    want_shm: bool
    hidden_share: _common_pb2.HiddenShare
    hidden_rows: _common_pb2.HiddenRows
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., hidden: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., want_shm: _Optional[bool] = ..., hidden_share: _Optional[_Union[_common_pb2.HiddenShare, _Mapping]] = ..., hidden_rows: _Optional[_Union[_common_pb2.HiddenRows, _Mapping]] = ...) -> None: ...

class StartSessionResponse(_message.Message):
    __slots__ = ("session_id", "shm_channel")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    shm_channel: str
    def __init__(self, session_id: _Optional[str] = ..., shm_channel: _Optional[str] = ...) -> None: ...

class TreeSpec(_message.Message):
    __slots__ = ("num_nodes", "top_k", "depth")
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    num_nodes: int
    top_k: int
    depth: int
    def __init__(self, num_nodes: _Optional[int] = ..., top_k: _Optional[int] = ..., depth: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "prefix_len", "append_ids", "append_hidden", "num_tokens", "tree", "is_tree", "trace_context", "append_rows")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    APPEND_IDS_FIELD_NUMBER: _ClassVar[int]
    APPEND_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    IS_TREE_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    APPEND_ROWS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prefix_len: int
    append_ids: _containers.RepeatedScalarFieldContainer[int]
    append_hidden: _common_pb2.Tensor
    num_tokens: int
    tree: TreeSpec
    is_tree: bool
    trace_context: _containers.ScalarMap[str, str]
    append_rows: _common_pb2.HiddenRows
    def __init__(self, session_id: _Optional[str] = ..., prefix_len: _Optional[int] = ..., append_ids: _Optional[_Iterable[int]] = ..., append_hidden: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., num_tokens: _Optional[int] = ..., tree: _Optional[_Union[TreeSpec, _Mapping]] = ..., is_tree: _Optional[bool] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., append_rows: _Optional[_Union[_common_pb2.HiddenRows, _Mapping]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("session_id", "draft", "timings")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    draft: _common_pb2.DraftBlock
    timings: _common_pb2.StepTimings
    def __init__(self, session_id: _Optional[str] = ..., draft: _Optional[_Union[_common_pb2.DraftBlock, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.StepTimings, _Mapping]] = ...) -> None: ...

class DraftReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DraftReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class DraftStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftStats(_message.Message):
    __slots__ = ("active_sessions", "proposals", "shm_proposals", "shm_channels", "hidden_rows_shared", "hidden_rows_as_bytes", "hidden_buffers")
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    SHM_PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    SHM_CHANNELS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_ROWS_SHARED_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_ROWS_AS_BYTES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    active_sessions: int
    proposals: int
    shm_proposals: int
    shm_channels: int
    hidden_rows_shared: int
    hidden_rows_as_bytes: int
    hidden_buffers: int
    def __init__(self, active_sessions: _Optional[int] = ..., proposals: _Optional[int] = ..., shm_proposals: _Optional[int] = ..., shm_channels: _Optional[int] = ..., hidden_rows_shared: _Optional[int] = ..., hidden_rows_as_bytes: _Optional[int] = ..., hidden_buffers: _Optional[int] = ...) -> None: ...
