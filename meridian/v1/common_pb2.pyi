from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Trajectory(_message.Message):
    __slots__ = ("trajectory_id", "task_id", "group_id", "group_size", "prompt_token_ids", "completion_token_ids", "logprobs", "loss_mask", "policy_versions", "reward", "truncated", "finish_reason", "timings", "trace_context", "model", "region")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    task_id: str
    group_id: str
    group_size: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    policy_versions: _containers.RepeatedScalarFieldContainer[int]
    reward: float
    truncated: bool
    finish_reason: str
    timings: Timings
    trace_context: _containers.ScalarMap[str, str]
    model: str
    region: str
    def __init__(self, trajectory_id: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., group_size: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., completion_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., policy_versions: _Optional[_Iterable[int]] = ..., reward: _Optional[float] = ..., truncated: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., model: _Optional[str] = ..., region: _Optional[str] = ...) -> None: ...

class TrajectoryGroup(_message.Message):
    __slots__ = ("group_id", "trajectories")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    trajectories: _containers.RepeatedCompositeFieldContainer[Trajectory]
    def __init__(self, group_id: _Optional[str] = ..., trajectories: _Optional[_Iterable[_Union[Trajectory, _Mapping]]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("generate_s", "sandbox_s", "total_s", "created_unix")
    GENERATE_S_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    generate_s: float
    sandbox_s: float
    total_s: float
    created_unix: float
    def __init__(self, generate_s: _Optional[float] = ..., sandbox_s: _Optional[float] = ..., total_s: _Optional[float] = ..., created_unix: _Optional[float] = ...) -> None: ...
