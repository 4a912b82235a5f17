"""gRPC adapter of the envsandbox service over :mod:`services.envsandbox.sandbox`."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from meridian import metrics
from meridian.errors import InvalidArgument
from meridian.v1 import envsandbox_pb2 as pb
from meridian.v1 import envsandbox_pb2_grpc as pb_grpc
from services.envsandbox.backends import make_backend
from services.envsandbox.config import EnvSandboxConfig
from services.envsandbox.sandbox import ExecResult, LimitCaps, Sandbox, SandboxManager
from services.envsandbox.task_sources import load_tasks_dir
from services.envsandbox.tasks import Task, TaskSuite

log = logging.getLogger(__name__)



def task_to_pb(task: Task) -> pb.Task:
    return pb.Task(
        id=task.id,
        kind=task.kind,
        instruction=task.instruction,
        files=[pb.File(path=p, content=c.encode()) for p, c in task.files.items()],
        answer_path=task.answer_path,
        split=task.split,
        tests_wall_seconds=task.limits.wall_seconds,
    )


def _info(box: Sandbox, backend: str) -> pb.SandboxInfo:
    return pb.SandboxInfo(
        sandbox_id=box.sandbox_id,
        task_id=box.task.id if box.task else "",
        created_unix=box.created,
        expires_unix=box.expires,
        backend=backend,
        lease_seconds=box.lease_s,
    )


def _result_pb(r: ExecResult) -> pb.ExecResult:
    return pb.ExecResult(**dataclasses.asdict(r))


def _files(files: list[pb.File]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for f in files:
        if f.path in out:
            raise InvalidArgument(f"file {f.path!r} given twice")
        out[f.path] = f.content
    return out


class EnvSandboxService(pb_grpc.EnvSandboxServicer):
    """Tasks and sandboxes over gRPC."""

    service_names = (pb.DESCRIPTOR.services_by_name["EnvSandbox"].full_name,)

    def __init__(self, config: EnvSandboxConfig) -> None:
        self.config = config
        self.suite = TaskSuite.builtin()
        if config.tasks_dir:
            self.suite = TaskSuite([*self.suite.select(), *load_tasks_dir(Path(config.tasks_dir))])
        self.sandboxes = SandboxManager(
            make_backend(config),
            default_ttl_s=config.default_ttl_s,
            max_sandboxes=config.max_sandboxes,
            caps=LimitCaps(wait_seconds=config.max_create_wait_s),
        )
        self._reaper: asyncio.Task[None] | None = None
        self.metrics = metrics.ServiceMetrics("envsandbox", self._metric_values)

    def register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_EnvSandboxServicer_to_server(self, server)

    async def start(self) -> None:
        # Backend start-up also removes what a killed previous run left behind.
        await self.sandboxes.start()
        self._reaper = asyncio.create_task(self._reap_forever())

    async def stop(self) -> None:
        if self._reaper:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await self.sandboxes.close_all()

    async def _metric_values(self) -> list[metrics.Value]:
        """What the metrics endpoint exports: sandboxes alive and allowed, the room held for forks and asked for."""
        boxes = self.sandboxes
        return metrics.envsandbox_values(len(boxes.list()), self.config.max_sandboxes, boxes.reserved, boxes.slots.waiting, boxes.expired)

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            try:
                reaped = await self.sandboxes.reap_expired()
            except Exception:
                log.exception("reaping expired sandboxes failed")
                continue
            if reaped:
                log.info("closed %d sandboxes past their time-to-live or lease", len(reaped))

    # ------------------------------------------------------------ RPCs

    async def ListTasks(self, request: pb.ListTasksRequest, context: grpc.aio.ServicerContext) -> pb.ListTasksResponse:
        return pb.ListTasksResponse(tasks=[task_to_pb(t) for t in self.suite.select(request.split, request.kind)])

    async def GetTask(self, request: pb.GetTaskRequest, context: grpc.aio.ServicerContext) -> pb.Task:
        return task_to_pb(self.suite.get(request.task_id))

    async def Create(self, request: pb.CreateRequest, context: grpc.aio.ServicerContext) -> pb.SandboxInfo:
        task = self.suite.get(request.task_id) if request.task_id else None
        limits = None
        if request.HasField("limits"):
            base = self.sandboxes.default_limits
            limits = base.merged(
                memory_bytes=request.limits.memory_bytes,
                max_pids=request.limits.max_pids,
                cpu_seconds=request.limits.cpu_seconds,
                wall_seconds=request.limits.wall_seconds,
                max_output_bytes=request.limits.max_output_bytes,
                disk_bytes=request.limits.disk_bytes,
                cpus=request.limits.cpus,
            )
        box = await self.sandboxes.create(
            task=task,
            files=_files(list(request.files)),
            limits=limits,
            ttl_s=request.ttl_seconds,
            client_request_id=request.client_request_id,
            lease_s=request.lease_seconds,
            fork_reserve=request.fork_reserve,
            wait_s=request.wait_seconds,
        )
        return _info(box, self.sandboxes.backend.name)

    async def Exec(self, request: pb.ExecRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ExecChunk]:
        async for item in self.sandboxes.exec(
            request.sandbox_id,
            list(request.argv),
            stdin=request.stdin,
            env=dict(request.env),
            cwd=request.cwd,
            timeout_s=request.timeout_seconds,
        ):
            if isinstance(item, ExecResult):
                self.metrics.observe(metrics.SANDBOX_EXEC_SECONDS, item.wall_seconds, kind="exec")
                yield pb.ExecChunk(result=_result_pb(item))
            elif item[0] == "stdout":
                yield pb.ExecChunk(stdout=item[1])
            else:
                yield pb.ExecChunk(stderr=item[1])

    async def WriteFiles(self, request: pb.WriteFilesRequest, context: grpc.aio.ServicerContext) -> pb.WriteFilesResponse:
        await self.sandboxes.write_files(request.sandbox_id, _files(list(request.files)))
        return pb.WriteFilesResponse()

    async def ReadFiles(self, request: pb.ReadFilesRequest, context: grpc.aio.ServicerContext) -> pb.ReadFilesResponse:
        files = await self.sandboxes.read_files(request.sandbox_id, list(request.paths))
        return pb.ReadFilesResponse(files=[pb.File(path=p, content=c) for p, c in files.items()])

    async def Fork(self, request: pb.ForkRequest, context: grpc.aio.ServicerContext) -> pb.ForkResponse:
        copies = await self.sandboxes.fork(request.sandbox_id, request.count)
        return pb.ForkResponse(sandboxes=[_info(b, self.sandboxes.backend.name) for b in copies])

    async def RunTests(self, request: pb.RunTestsRequest, context: grpc.aio.ServicerContext) -> pb.RunTestsResponse:
        outcome, result, output = await self.sandboxes.run_tests(request.sandbox_id)
        self.metrics.observe(metrics.SANDBOX_EXEC_SECONDS, result.wall_seconds, kind="tests")
        return pb.RunTestsResponse(
            reward=outcome.reward,
            tests=[pb.TestCaseResult(name=n, passed=ok, detail=d) for n, ok, d in outcome.cases],
            exec=_result_pb(result),
            output=output[:65536],
        )

    async def Close(self, request: pb.CloseRequest, context: grpc.aio.ServicerContext) -> pb.CloseResponse:
        await self.sandboxes.close(request.sandbox_id)
        return pb.CloseResponse()

    async def List(self, request: pb.ListRequest, context: grpc.aio.ServicerContext) -> pb.ListResponse:
        return pb.ListResponse(sandboxes=[_info(b, self.sandboxes.backend.name) for b in self.sandboxes.list()], max_sandboxes=self.sandboxes.max_sandboxes)

    async def Renew(self, request: pb.RenewRequest, context: grpc.aio.ServicerContext) -> pb.RenewResponse:
        return pb.RenewResponse(gone=self.sandboxes.renew(request.sandbox_ids))
