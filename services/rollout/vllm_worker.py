"""Methods injected into vLLM's worker processes (``worker_extension_cls``), called by
name through ``collective_rpc``; naming a method keeps pickled code out of the RPC."""
from __future__ import annotations


class WeightUpdateExtension:
    """Loads a policy version into the running model, in place."""

    def meridian_reload_weights(self, path: str) -> str:
        """Reloads every tensor of a safetensors file (checkpoint names) into the model and
        returns the weights hash of exactly what was loaded, for the caller to verify."""
        from safetensors.torch import load_file

        from services.weightsync.tensors import from_torch, weights_hash

        tensors = load_file(path)
        # reload_weights (not model.load_weights): the CPU backend repacks weights after loading.
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))  # type: ignore[attr-defined]
        return weights_hash({name: from_torch(t) for name, t in tensors.items()})
