from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class File(_message.Message):
    __slots__ = ("path", "content", "mode")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    path: str
    content: bytes
    mode: int
    def __init__(self, path: _Optional[str] = ..., content: _Optional[bytes] = ..., mode: _Optional[int] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("id", "kind", "instruction", "files", "answer_path", "split", "tests_wall_seconds")
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    ANSWER_PATH_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    TESTS_WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    kind: str
    instruction: str
    files: _containers.RepeatedCompositeFieldContainer[File]
    answer_path: str
    split: str
    tests_wall_seconds: float
    def __init__(self, id: _Optional[str] = ..., kind: _Optional[str] = ..., instruction: _Optional[str] = ..., files: _Optional[_Iterable[_Union[File, _Mapping]]] = ..., answer_path: _Optional[str] = ..., split: _Optional[str] = ..., tests_wall_seconds: _Optional[float] = ...) -> None: ...

class ListTasksRequest(_message.Message):
    __slots__ = ("split", "kind")
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    split: str
    kind: str
    def __init__(self, split: _Optional[str] = ..., kind: _Optional[str] = ...) -> None: ...

class ListTasksResponse(_message.Message):
    __slots__ = ("tasks",)
    TASKS_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[Task]
    def __init__(self, tasks: _Optional[_Iterable[_Union[Task, _Mapping]]] = ...) -> None: ...

class GetTaskRequest(_message.Message):
    __slots__ = ("task_id",)
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    def __init__(self, task_id: _Optional[str] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("memory_bytes", "max_pids", "cpu_seconds", "wall_seconds", "max_output_bytes", "disk_bytes", "cpus")
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_PIDS_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    memory_bytes: int
    max_pids: int
    cpu_seconds: float
    wall_seconds: float
    max_output_bytes: int
    disk_bytes: int
    cpus: float
    def __init__(self, memory_bytes: _Optional[int] = ..., max_pids: _Optional[int] = ..., cpu_seconds: _Optional[float] = ..., wall_seconds: _Optional[float] = ..., max_output_bytes: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., cpus: _Optional[float] = ...) -> None: ...

class CreateRequest(_message.Message):
    __slots__ = ("task_id", "files", "limits", "ttl_seconds", "client_request_id", "lease_seconds", "fork_reserve", "wait_seconds")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORK_RESERVE_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    files: _containers.RepeatedCompositeFieldContainer[File]
    limits: Limits
    ttl_seconds: float
    client_request_id: str
    lease_seconds: float
    fork_reserve: int
    wait_seconds: float
    def __init__(self, task_id: _Optional[str] = ..., files: _Optional[_Iterable[_Union[File, _Mapping]]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., ttl_seconds: _Optional[float] = ..., client_request_id: _Optional[str] = ..., lease_seconds: _Optional[float] = ..., fork_reserve: _Optional[int] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class SandboxInfo(_message.Message):
    __slots__ = ("sandbox_id", "task_id", "created_unix", "expires_unix", "backend", "lease_seconds")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    task_id: str
    created_unix: float
    expires_unix: float
    backend: str
    lease_seconds: float
    def __init__(self, sandbox_id: _Optional[str] = ..., task_id: _Optional[str] = ..., created_unix: _Optional[float] = ..., expires_unix: _Optional[float] = ..., backend: _Optional[str] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class ExecRequest(_message.Message):
    __slots__ = ("sandbox_id", "argv", "stdin", "env", "cwd", "timeout_seconds")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    argv: _containers.RepeatedScalarFieldContainer[str]
    stdin: bytes
    env: _containers.ScalarMap[str, str]
    cwd: str
    timeout_seconds: float
    def __init__(self, sandbox_id: _Optional[str] = ..., argv: _Optional[_Iterable[str]] = ..., stdin: _Optional[bytes] = ..., env: _Optional[_Mapping[str, str]] = ..., cwd: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class ExecResult(_message.Message):
    __slots__ = ("exit_code", "signal", "timed_out", "stdout_truncated", "stderr_truncated", "wall_seconds", "oom_killed")
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    STDOUT_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STDERR_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OOM_KILLED_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    signal: int
    timed_out: bool
    stdout_truncated: bool
    stderr_truncated: bool
    wall_seconds: float
    oom_killed: bool
    def __init__(self, exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., timed_out: _Optional[bool] = ..., stdout_truncated: _Optional[bool] = ..., stderr_truncated: _Optional[bool] = ..., wall_seconds: _Optional[float] = ..., oom_killed: _Optional[bool] = ...) -> None: ...

class ExecChunk(_message.Message):
    __slots__ = ("stdout", "stderr", "result")
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    stdout: bytes
    stderr: bytes
    result: ExecResult
    def __init__(self, stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., result: _Optional[_Union[ExecResult, _Mapping]] = ...) -> None: ...

class WriteFilesRequest(_message.Message):
    __slots__ = ("sandbox_id", "files")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    files: _containers.RepeatedCompositeFieldContainer[File]
    def __init__(self, sandbox_id: _Optional[str] = ..., files: _Optional[_Iterable[_Union[File, _Mapping]]] = ...) -> None: ...

class WriteFilesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReadFilesRequest(_message.Message):
    __slots__ = ("sandbox_id", "paths")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sandbox_id: _Optional[str] = ..., paths: _Optional[_Iterable[str]] = ...) -> None: ...

class ReadFilesResponse(_message.Message):
    __slots__ = ("files",)
    FILES_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[File]
    def __init__(self, files: _Optional[_Iterable[_Union[File, _Mapping]]] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("sandbox_id", "count")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    count: int
    def __init__(self, sandbox_id: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class ForkResponse(_message.Message):
    __slots__ = ("sandboxes",)
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    sandboxes: _containers.RepeatedCompositeFieldContainer[SandboxInfo]
    def __init__(self, sandboxes: _Optional[_Iterable[_Union[SandboxInfo, _Mapping]]] = ...) -> None: ...

class TestCaseResult(_message.Message):
    __slots__ = ("name", "passed", "detail")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    name: str
    passed: bool
    detail: str
    def __init__(self, name: _Optional[str] = ..., passed: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class RunTestsRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class RunTestsResponse(_message.Message):
    __slots__ = ("reward", "tests", "exec", "output")
    REWARD_FIELD_NUMBER: _ClassVar[int]
    TESTS_FIELD_NUMBER: _ClassVar[int]
    EXEC_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    reward: float
    tests: _containers.RepeatedCompositeFieldContainer[TestCaseResult]
    exec: ExecResult
    output: bytes
    def __init__(self, reward: _Optional[float] = ..., tests: _Optional[_Iterable[_Union[TestCaseResult, _Mapping]]] = ..., exec: _Optional[_Union[ExecResult, _Mapping]] = ..., output: _Optional[bytes] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("sandboxes", "max_sandboxes")
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    MAX_SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    sandboxes: _containers.RepeatedCompositeFieldContainer[SandboxInfo]
    max_sandboxes: int
    def __init__(self, sandboxes: _Optional[_Iterable[_Union[SandboxInfo, _Mapping]]] = ..., max_sandboxes: _Optional[int] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("sandbox_ids",)
    SANDBOX_IDS_FIELD_NUMBER: _ClassVar[int]
    sandbox_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sandbox_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ("gone",)
    GONE_FIELD_NUMBER: _ClassVar[int]
    gone: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, gone: _Optional[_Iterable[str]] = ...) -> None: ...
