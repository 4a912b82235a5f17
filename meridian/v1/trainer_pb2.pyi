from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrainerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("step", "policy_version", "loss", "reward_mean", "trajectories", "groups", "step_seconds", "grad_norm", "dropped_stale")
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    step: int
    policy_version: int
    loss: float
    reward_mean: float
    trajectories: int
    groups: int
    step_seconds: float
    grad_norm: float
    dropped_stale: int
    def __init__(self, step: _Optional[int] = ..., policy_version: _Optional[int] = ..., loss: _Optional[float] = ..., reward_mean: _Optional[float] = ..., trajectories: _Optional[int] = ..., groups: _Optional[int] = ..., step_seconds: _Optional[float] = ..., grad_norm: _Optional[float] = ..., dropped_stale: _Optional[int] = ...) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("step", "policy_version", "trajectories_consumed", "trajectories_pending", "recent_steps", "model")
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_PENDING_FIELD_NUMBER: _ClassVar[int]
    RECENT_STEPS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    step: int
    policy_version: int
    trajectories_consumed: int
    trajectories_pending: int
    recent_steps: _containers.RepeatedCompositeFieldContainer[StepMetrics]
    model: str
    def __init__(self, step: _Optional[int] = ..., policy_version: _Optional[int] = ..., trajectories_consumed: _Optional[int] = ..., trajectories_pending: _Optional[int] = ..., recent_steps: _Optional[_Iterable[_Union[StepMetrics, _Mapping]]] = ..., model: _Optional[str] = ...) -> None: ...
