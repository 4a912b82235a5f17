from meridian.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "max_tokens", "stop", "seed", "min_tokens")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    min_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "sampling", "request_id")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    request_id: str
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "policy_versions", "text", "finished", "finish_reason", "completion_policy_versions")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    policy_versions: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: bool
    finish_reason: str
    completion_policy_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., policy_versions: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., completion_policy_versions: _Optional[_Iterable[int]] = ...) -> None: ...

class RunEpisodesRequest(_message.Message):
    __slots__ = ("task_ids", "num_tasks", "group_size", "sampling", "publish")
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TASKS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_FIELD_NUMBER: _ClassVar[int]
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    num_tasks: int
    group_size: int
    sampling: SamplingParams
    publish: bool
    def __init__(self, task_ids: _Optional[_Iterable[str]] = ..., num_tasks: _Optional[int] = ..., group_size: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., publish: _Optional[bool] = ...) -> None: ...

class RunEpisodesResponse(_message.Message):
    __slots__ = ("trajectories",)
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    trajectories: _containers.RepeatedCompositeFieldContainer[_common_pb2.Trajectory]
    def __init__(self, trajectories: _Optional[_Iterable[_Union[_common_pb2.Trajectory, _Mapping]]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("logprobs", "policy_version")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    policy_version: int
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., policy_version: _Optional[int] = ...) -> None: ...

class RolloutStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutStatus(_message.Message):
    __slots__ = ("policy_version", "model", "weights_hash", "episodes_completed", "updates_applied", "weightsync_address", "latest_published_version", "rl_state", "rl_trajectories_published", "http_port", "last_apply_ms", "apply_path", "updates_rejected", "rejected_version", "last_update_error", "canary_mean_diff", "canary_max_diff", "readback_elements", "rl_concurrency_limit", "rl_running", "rl_preemptions", "slo_attainment", "rl_token_share", "production_in_flight", "rl_tokens", "production_tokens", "region", "sandboxes_held", "groups_waiting_for_sandboxes", "sandbox_budget")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_HASH_FIELD_NUMBER: _ClassVar[int]
    EPISODES_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    UPDATES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    WEIGHTSYNC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LATEST_PUBLISHED_VERSION_FIELD_NUMBER: _ClassVar[int]
    RL_STATE_FIELD_NUMBER: _ClassVar[int]
    RL_TRAJECTORIES_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    HTTP_PORT_FIELD_NUMBER: _ClassVar[int]
    LAST_APPLY_MS_FIELD_NUMBER: _ClassVar[int]
    APPLY_PATH_FIELD_NUMBER: _ClassVar[int]
    UPDATES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_UPDATE_ERROR_FIELD_NUMBER: _ClassVar[int]
    CANARY_MEAN_DIFF_FIELD_NUMBER: _ClassVar[int]
    CANARY_MAX_DIFF_FIELD_NUMBER: _ClassVar[int]
    READBACK_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    RL_CONCURRENCY_LIMIT_FIELD_NUMBER: _ClassVar[int]
    RL_RUNNING_FIELD_NUMBER: _ClassVar[int]
    RL_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    SLO_ATTAINMENT_FIELD_NUMBER: _ClassVar[int]
    RL_TOKEN_SHARE_FIELD_NUMBER: _ClassVar[int]
    PRODUCTION_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    RL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRODUCTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    SANDBOXES_HELD_FIELD_NUMBER: _ClassVar[int]
    GROUPS_WAITING_FOR_SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_BUDGET_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    model: str
    weights_hash: str
    episodes_completed: int
    updates_applied: int
    weightsync_address: str
    latest_published_version: int
    rl_state: str
    rl_trajectories_published: int
    http_port: int
    last_apply_ms: float
    apply_path: str
    updates_rejected: int
    rejected_version: int
    last_update_error: str
    canary_mean_diff: float
    canary_max_diff: float
    readback_elements: int
    rl_concurrency_limit: int
    rl_running: int
    rl_preemptions: int
    slo_attainment: float
    rl_token_share: float
    production_in_flight: int
    rl_tokens: int
    production_tokens: int
    region: str
    sandboxes_held: int
    groups_waiting_for_sandboxes: int
    sandbox_budget: int
    def __init__(self, policy_version: _Optional[int] = ..., model: _Optional[str] = ..., weights_hash: _Optional[str] = ..., episodes_completed: _Optional[int] = ..., updates_applied: _Optional[int] = ..., weightsync_address: _Optional[str] = ..., latest_published_version: _Optional[int] = ..., rl_state: _Optional[str] = ..., rl_trajectories_published: _Optional[int] = ..., http_port: _Optional[int] = ..., last_apply_ms: _Optional[float] = ..., apply_path: _Optional[str] = ..., updates_rejected: _Optional[int] = ..., rejected_version: _Optional[int] = ..., last_update_error: _Optional[str] = ..., canary_mean_diff: _Optional[float] = ..., canary_max_diff: _Optional[float] = ..., readback_elements: _Optional[int] = ..., rl_concurrency_limit: _Optional[int] = ..., rl_running: _Optional[int] = ..., rl_preemptions: _Optional[int] = ..., slo_attainment: _Optional[float] = ..., rl_token_share: _Optional[float] = ..., production_in_flight: _Optional[int] = ..., rl_tokens: _Optional[int] = ..., production_tokens: _Optional[int] = ..., region: _Optional[str] = ..., sandboxes_held: _Optional[int] = ..., groups_waiting_for_sandboxes: _Optional[int] = ..., sandbox_budget: _Optional[int] = ...) -> None: ...
