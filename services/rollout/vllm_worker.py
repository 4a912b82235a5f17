"""Methods injected into vLLM's worker processes (``worker_extension_cls``), called by
name through ``collective_rpc``; naming a method keeps pickled code out of the RPC.

The element-level update path lives in :mod:`services.rollout.served_weights`; these
methods are its thin process boundary (arguments and results are builtins and numpy).
"""
from __future__ import annotations

from typing import Any


class WeightUpdateExtension:
    """Loads policy versions into the running model, in place."""

    def meridian_prepare(self, checkpoint: dict[str, tuple[str, list[int]]], files: list[str]) -> dict[str, Any]:
        """Sets up element-level updates; returns the layout and a read-back of every
        tensor as vLLM loaded it (the caller checks both against the checkpoint), or
        ``{"error": ...}`` when this engine's loader cannot be followed element-wise."""
        from services.rollout.served_weights import ServedWeights
        from services.rollout.weight_layout import LayoutError

        served = ServedWeights(self.model_runner.get_model())  # type: ignore[attr-defined]
        try:
            layout = served.prepare({n: (d, tuple(s)) for n, (d, s) in checkpoint.items()}, files)
        except LayoutError as exc:
            return {"error": str(exc)}
        import numpy as np

        samples = served.readback({t: np.zeros(0, dtype=np.int64) for t in served.targets})
        self._meridian_served = served
        return {
            "layout": layout.as_plain(),
            "samples": [s.as_plain() for s in samples],
            "shadow_bytes": sum(t.logical.numel() * t.logical.element_size() for t in served.targets.values() if not t.live),
        }

    def meridian_apply(self, changes: dict[str, Any], verify: dict[str, Any]) -> dict[str, Any]:
        """Writes a change set (``ChangeSet.as_plain()``) and returns the read-back of
        the positions ``verify`` names (engine tensor -> packed positions)."""
        return self._served().apply(changes, verify)

    def meridian_commit(self) -> None:
        self._served().commit()

    def meridian_revert(self) -> dict[str, Any]:
        return self._served().revert()

    def meridian_self_check(self) -> int:
        """Mismatches between what the kernels compute with and the held logical tensors."""
        return self._served().self_check()

    def meridian_full_reload(self, path: str) -> int:
        """The fallback for engines whose loader cannot be followed element-wise: vLLM's
        ``reload_weights`` of a whole safetensors file, then the post-load processing of
        every module that shares a reloaded parameter but got no weights of its own (the
        tied ``lm_head``, whose packed copy ``reload_weights`` leaves stale). Returns how
        many such modules were re-processed."""
        from safetensors.torch import load_file

        tensors = load_file(path)
        runner = self.model_runner  # type: ignore[attr-defined]
        runner.reload_weights(weights_iterator=iter(tensors.items()))
        return _reprocess_shared(runner.get_model())

    def _served(self) -> Any:
        served = getattr(self, "_meridian_served", None)
        if served is None:
            raise RuntimeError("meridian_prepare has not succeeded in this worker")
        return served


def _reprocess_shared(model: Any) -> int:
    """Re-runs post-load processing for modules holding a parameter another module owns."""
    seen: dict[int, str] = {}
    redo = []
    for path, module in model.named_modules(remove_duplicate=False):
        for param in module._parameters.values():
            if param is None:
                continue
            if id(param) in seen and seen[id(param)] != path:
                redo.append(module)
            seen.setdefault(id(param), path)
    for module in redo:
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    return len(redo)

