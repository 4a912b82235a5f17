"""Methods injected into vLLM's worker processes (``worker_extension_cls``), called by
name through ``collective_rpc``; naming a method keeps pickled code out of the RPC."""
from __future__ import annotations


class WeightUpdateExtension:
    """Loads a new policy version into the running model, in place."""

    def meridian_reload_weights(self, path: str) -> int:
        """Reloads every tensor of a safetensors file (checkpoint names) into the model."""
        from safetensors.torch import load_file

        tensors = load_file(path)
        # reload_weights (not model.load_weights) because the CPU backend repacks weights after loading.
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))  # type: ignore[attr-defined]
        return len(tensors)
