from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenSessionRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "max_model_len")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    max_model_len: int
    def __init__(self, session_id: _Optional[str] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ForkSessionRequest(_message.Message):
    __slots__ = ("session_id", "at_position")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    AT_POSITION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    at_position: int
    def __init__(self, session_id: _Optional[str] = ..., at_position: _Optional[int] = ...) -> None: ...

class ForkSessionResponse(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ImageAttachment(_message.Message):
    __slots__ = ("bytes", "mime", "pad_range_start", "pad_range_end")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MIME_FIELD_NUMBER: _ClassVar[int]
    PAD_RANGE_START_FIELD_NUMBER: _ClassVar[int]
    PAD_RANGE_END_FIELD_NUMBER: _ClassVar[int]
    bytes: bytes
    mime: str
    pad_range_start: int
    pad_range_end: int
    def __init__(self, bytes: _Optional[bytes] = ..., mime: _Optional[str] = ..., pad_range_start: _Optional[int] = ..., pad_range_end: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("session_id", "append_tokens", "offset", "truncating", "max_tokens", "logprobs_ranges", "logprob_top_k", "readout_ranges", "temperature", "top_p", "top_k", "stop_token_ids", "priority", "images")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TRUNCATING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_RANGES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_TOP_K_FIELD_NUMBER: _ClassVar[int]
    READOUT_RANGES_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    append_tokens: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    truncating: bool
    max_tokens: int
    logprobs_ranges: _containers.RepeatedCompositeFieldContainer[PositionRange]
    logprob_top_k: int
    readout_ranges: _containers.RepeatedCompositeFieldContainer[PositionRange]
    temperature: float
    top_p: float
    top_k: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    images: _containers.RepeatedCompositeFieldContainer[ImageAttachment]
    def __init__(self, session_id: _Optional[str] = ..., append_tokens: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., truncating: _Optional[bool] = ..., max_tokens: _Optional[int] = ..., logprobs_ranges: _Optional[_Iterable[_Union[PositionRange, _Mapping]]] = ..., logprob_top_k: _Optional[int] = ..., readout_ranges: _Optional[_Iterable[_Union[PositionRange, _Mapping]]] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ..., images: _Optional[_Iterable[_Union[ImageAttachment, _Mapping]]] = ...) -> None: ...

class PositionRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("token", "done")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    token: Token
    done: GenerateDone
    def __init__(self, token: _Optional[_Union[Token, _Mapping]] = ..., done: _Optional[_Union[GenerateDone, _Mapping]] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("id", "position", "is_prefill", "readout", "logprobs", "sampled_logprob", "has_sampled_logprob")
    ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    IS_PREFILL_FIELD_NUMBER: _ClassVar[int]
    READOUT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    HAS_SAMPLED_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    id: int
    position: int
    is_prefill: bool
    readout: _containers.RepeatedScalarFieldContainer[float]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    sampled_logprob: float
    has_sampled_logprob: bool
    def __init__(self, id: _Optional[int] = ..., position: _Optional[int] = ..., is_prefill: _Optional[bool] = ..., readout: _Optional[_Iterable[float]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., sampled_logprob: _Optional[float] = ..., has_sampled_logprob: _Optional[bool] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("id", "logprob")
    ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    id: int
    logprob: float
    def __init__(self, id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class GenerateDone(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens", "finish_reason")
    class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        FINISH_REASON_UNSPECIFIED: _ClassVar[GenerateDone.FinishReason]
        FINISH_REASON_EOS: _ClassVar[GenerateDone.FinishReason]
        FINISH_REASON_LENGTH: _ClassVar[GenerateDone.FinishReason]
        FINISH_REASON_CANCELLED: _ClassVar[GenerateDone.FinishReason]
        FINISH_REASON_STOP_STRING: _ClassVar[GenerateDone.FinishReason]
    FINISH_REASON_UNSPECIFIED: GenerateDone.FinishReason
    FINISH_REASON_EOS: GenerateDone.FinishReason
    FINISH_REASON_LENGTH: GenerateDone.FinishReason
    FINISH_REASON_CANCELLED: GenerateDone.FinishReason
    FINISH_REASON_STOP_STRING: GenerateDone.FinishReason
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    finish_reason: GenerateDone.FinishReason
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[GenerateDone.FinishReason, str]] = ...) -> None: ...

class GetReadoutManifestRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReadoutManifest(_message.Message):
    __slots__ = ("concepts", "layers", "hidden_size", "dtype")
    CONCEPTS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    concepts: _containers.RepeatedScalarFieldContainer[str]
    layers: _containers.RepeatedScalarFieldContainer[int]
    hidden_size: int
    dtype: str
    def __init__(self, concepts: _Optional[_Iterable[str]] = ..., layers: _Optional[_Iterable[int]] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class DumpSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DumpSessionResponse(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...
