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
    __slots__ = ("step", "policy_version", "loss", "reward_mean", "trajectories", "groups", "step_seconds", "grad_norm", "dropped_stale", "downweighted_stale", "dropped_groups", "pass_rate", "policy_lag_mean", "policy_lag_max", "published", "weightsync_raw_bytes", "weightsync_encoded_bytes", "lr", "stepped", "tis_weight_mean", "kl", "peak_rss_mb", "commit_seconds", "publish_seconds", "trajectories_by_region")
    class TrajectoriesByRegionEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    DOWNWEIGHTED_STALE_FIELD_NUMBER: _ClassVar[int]
    DROPPED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    PASS_RATE_FIELD_NUMBER: _ClassVar[int]
    POLICY_LAG_MEAN_FIELD_NUMBER: _ClassVar[int]
    POLICY_LAG_MAX_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    WEIGHTSYNC_RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTSYNC_ENCODED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    STEPPED_FIELD_NUMBER: _ClassVar[int]
    TIS_WEIGHT_MEAN_FIELD_NUMBER: _ClassVar[int]
    KL_FIELD_NUMBER: _ClassVar[int]
    PEAK_RSS_MB_FIELD_NUMBER: _ClassVar[int]
    COMMIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_BY_REGION_FIELD_NUMBER: _ClassVar[int]
    step: int
    policy_version: int
    loss: float
    reward_mean: float
    trajectories: int
    groups: int
    step_seconds: float
    grad_norm: float
    dropped_stale: int
    downweighted_stale: int
    dropped_groups: int
    pass_rate: float
    policy_lag_mean: float
    policy_lag_max: int
    published: bool
    weightsync_raw_bytes: int
    weightsync_encoded_bytes: int
    lr: float
    stepped: bool
    tis_weight_mean: float
    kl: float
    peak_rss_mb: float
    commit_seconds: float
    publish_seconds: float
    trajectories_by_region: _containers.ScalarMap[str, int]
    def __init__(self, step: _Optional[int] = ..., policy_version: _Optional[int] = ..., loss: _Optional[float] = ..., reward_mean: _Optional[float] = ..., trajectories: _Optional[int] = ..., groups: _Optional[int] = ..., step_seconds: _Optional[float] = ..., grad_norm: _Optional[float] = ..., dropped_stale: _Optional[int] = ..., downweighted_stale: _Optional[int] = ..., dropped_groups: _Optional[int] = ..., pass_rate: _Optional[float] = ..., policy_lag_mean: _Optional[float] = ..., policy_lag_max: _Optional[int] = ..., published: _Optional[bool] = ..., weightsync_raw_bytes: _Optional[int] = ..., weightsync_encoded_bytes: _Optional[int] = ..., lr: _Optional[float] = ..., stepped: _Optional[bool] = ..., tis_weight_mean: _Optional[float] = ..., kl: _Optional[float] = ..., peak_rss_mb: _Optional[float] = ..., commit_seconds: _Optional[float] = ..., publish_seconds: _Optional[float] = ..., trajectories_by_region: _Optional[_Mapping[str, int]] = ...) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("step", "policy_version", "trajectories_consumed", "trajectories_pending", "recent_steps", "model", "dropped_stale_total", "downweighted_stale_total", "dead_lettered", "duplicates_skipped", "claimed", "checkpoint_step", "resumed_from_step", "dropped_groups_total", "skipped_steps_total", "publishes_given_up_total")
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_PENDING_FIELD_NUMBER: _ClassVar[int]
    RECENT_STEPS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DOWNWEIGHTED_STALE_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    DROPPED_GROUPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PUBLISHES_GIVEN_UP_TOTAL_FIELD_NUMBER: _ClassVar[int]
    step: int
    policy_version: int
    trajectories_consumed: int
    trajectories_pending: int
    recent_steps: _containers.RepeatedCompositeFieldContainer[StepMetrics]
    model: str
    dropped_stale_total: int
    downweighted_stale_total: int
    dead_lettered: int
    duplicates_skipped: int
    claimed: int
    checkpoint_step: int
    resumed_from_step: int
    dropped_groups_total: int
    skipped_steps_total: int
    publishes_given_up_total: int
    def __init__(self, step: _Optional[int] = ..., policy_version: _Optional[int] = ..., trajectories_consumed: _Optional[int] = ..., trajectories_pending: _Optional[int] = ..., recent_steps: _Optional[_Iterable[_Union[StepMetrics, _Mapping]]] = ..., model: _Optional[str] = ..., dropped_stale_total: _Optional[int] = ..., downweighted_stale_total: _Optional[int] = ..., dead_lettered: _Optional[int] = ..., duplicates_skipped: _Optional[int] = ..., claimed: _Optional[int] = ..., checkpoint_step: _Optional[int] = ..., resumed_from_step: _Optional[int] = ..., dropped_groups_total: _Optional[int] = ..., skipped_steps_total: _Optional[int] = ..., publishes_given_up_total: _Optional[int] = ...) -> None: ...
