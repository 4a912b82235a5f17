"""Test-only hooks, loaded at start-up by every Python process of a rollout that a test
launches with this folder on PYTHONPATH. Nothing here is imported by Meridian itself.

MERIDIAN_TEST_CPU=avx2
    The process sees a CPU without AVX-512, AVX512-BF16 or AMX, so vLLM loads its AVX2
    kernel library and packs every linear layer with oneDNN (never with the AMX kernels):
    the code path of a CPU like an AMD EPYC with AVX2, on whatever CPU runs the tests.

MERIDIAN_TEST_STEP_DELAY_S=<seconds>
    Every engine step (vLLM's ``GPUModelRunner.execute_model``, which the CPU runner
    inherits) sleeps this long first: requests last long enough, without keeping the
    CPU busy, for an update published meanwhile to land in the middle of them.

MERIDIAN_TEST_SABOTAGE=<json file>
    Breaks the update of one version in the engine's worker, as a bug would, so a test
    can check that the update is caught and rolled back. The file holds
    {"version": N, "kind": ..., "tensors": [...]}; kinds:
      drop   -- the changes of tensors[0] are never written;
      swap   -- tensors[0]'s changes are written into tensors[1] and the other way round;
      stale-head -- modules sharing a tensor with another (the tied lm_head) are neither
                    re-processed nor read back (on the full path: not re-processed after
                    vLLM's reload, whatever the version): the mixed model of a stale head.
                    Whether that left anything stale depends on the CPU: where vLLM packs
                    the head's weight (oneDNN) the packed copy goes stale; where it falls
                    back to a plain linear on the shared tensor (an AVX2-only CPU, whose
                    oneDNN declines bf16) nothing can. The hook writes what it found to
                    <json file>.effect, {"stale": true|false}, for the test to tell the
                    two apart.
"""
import json
import os


def _pretend_avx2() -> None:
    import torch

    for name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda: False)


def _shared_users_are_stale(model) -> bool:  # type: ignore[no-untyped-def]
    """Whether a module sharing a parameter with another computes with something else than
    that parameter (a processed copy left behind): its own forward on a probe against a
    plain linear on the shared tensor."""
    import torch

    seen: dict[int, str] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for param in module._parameters.values():
            if param is None:
                continue
            if id(param) in seen and seen[id(param)] != path and getattr(module, "quant_method", None) is not None:
                probe = torch.randn(2, param.shape[-1], dtype=param.dtype, generator=torch.Generator().manual_seed(0))
                with torch.no_grad():
                    got = module.quant_method.apply(module, probe)
                    want = torch.nn.functional.linear(probe, param)
                if not torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2):
                    return True
            seen.setdefault(id(param), path)
    return False


def _sabotage(spec_path: str) -> None:
    from services.rollout import served_weights, vllm_worker

    def current() -> dict:
        try:
            with open(spec_path) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return {}

    def record(stale: bool) -> None:
        with open(spec_path + ".effect", "w") as fh:
            json.dump({"stale": stale}, fh)

    def spec(version: int) -> dict | None:
        data = current()
        return data if data.get("version") == version else None

    apply = served_weights.ServedWeights.apply

    def sabotaged_apply(self, changes, verify):  # type: ignore[no-untyped-def]
        s = spec(changes["version"])
        if s and s["kind"] == "drop":
            changes = {**changes, "sparse": {n: v for n, v in changes["sparse"].items() if n != s["tensors"][0]}}
        elif s and s["kind"] == "swap":
            a, b = s["tensors"]
            sparse = dict(changes["sparse"])
            sparse[a], sparse[b] = changes["sparse"][b], changes["sparse"][a]
            changes = {**changes, "sparse": sparse}
        elif s and s["kind"] == "stale-head":
            users = {name: target.users for name, target in self.targets.items()}
            for target in self.targets.values():
                target.users = target.users[:1]
            try:
                return apply(self, changes, verify)
            finally:
                for name, target in self.targets.items():
                    target.users = users[name]
                record(_shared_users_are_stale(self.model))
        return apply(self, changes, verify)

    served_weights.ServedWeights.apply = sabotaged_apply
    reprocess = vllm_worker._reprocess_shared
    # The full path (a whole reload) names no version: the file's kind alone decides.
    def sabotaged_reprocess(model):  # type: ignore[no-untyped-def]
        if current().get("kind") != "stale-head":
            return reprocess(model)
        record(_shared_users_are_stale(model))
        return 0

    vllm_worker._reprocess_shared = sabotaged_reprocess


def _after_import(module_name: str, patch) -> None:  # type: ignore[no-untyped-def]
    """Runs ``patch(module)`` once ``module_name`` has been imported (without importing it)."""
    import importlib.abc
    import sys

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
            if name != module_name:
                return None
            sys.meta_path.remove(self)
            import importlib.util

            spec = importlib.util.find_spec(name)
            loader = spec.loader
            run = loader.exec_module

            def exec_module(module):  # type: ignore[no-untyped-def]
                run(module)
                patch(module)

            loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


def _slow_steps(delay_s: float) -> None:
    def patch(module):  # type: ignore[no-untyped-def]
        import time

        runner = module.GPUModelRunner
        execute = runner.execute_model

        def slow_execute(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            time.sleep(delay_s)
            return execute(self, *args, **kwargs)

        runner.execute_model = slow_execute

    _after_import("vllm.v1.worker.gpu_model_runner", patch)


if os.environ.get("MERIDIAN_TEST_STEP_DELAY_S"):
    _slow_steps(float(os.environ["MERIDIAN_TEST_STEP_DELAY_S"]))
if os.environ.get("MERIDIAN_TEST_CPU") == "avx2":
    _pretend_avx2()
if os.environ.get("MERIDIAN_TEST_SABOTAGE"):
    _sabotage(os.environ["MERIDIAN_TEST_SABOTAGE"])
