"""The engine's weights, updated in place element by element, inside a vLLM worker.

Why vLLM's own ``reload_weights`` is not enough (the root cause behind a served model
that mixed two versions): on the CPU backend every linear layer's weight is handed to a
kernel-specific packed copy after loading (``dispatch_cpu_unquantized_gemm``: a oneDNN
handle on AVX2/AVX-512, an SGL VNNI-packed tensor on AMX CPUs for small layers) and the
layer's ``weight`` becomes an empty tensor. ``reload_weights`` re-runs that packing only
for the layers it loads weights into. A tied ``lm_head`` receives no weights of its own
(it shares the embedding), so its packed copy keeps version 0 forever
("ParallelLMHead: Failed to load weights" in the log): the served model computes its
hidden states with the new weights and its output head with the first ones. The
embedding and norms are refreshed, so nothing looks wrong until the log-probs are
compared. Which layers pack, and how, depends on the CPU (AMX, AVX-512, AVX2), so the
fault showed on some machines and not others.

What this module does instead:

1. **Layout** (:meth:`ServedWeights.prepare`): records, on the meta device, where vLLM's
   own loader copies each checkpoint tensor (fused ``qkv_proj``, ``gate_up_proj``, ...),
   as a :class:`~services.rollout.weight_layout.WeightLayout`.
2. **Logical tensors**: every engine tensor in its loader format. Tensors the engine
   still computes with directly (embedding, norms; every tensor on CUDA) *are* the
   logical ones; for the ones the CPU backend packed away, the worker keeps a copy (filled
   from the checkpoint files once).
3. **Apply** (:meth:`ServedWeights.apply`): write only the changed elements into the
   logical tensors, remembering what they overwrote, then re-run the backend's
   post-load processing (``quant_method.process_weights_after_loading``) for exactly
   the modules that compute with a touched tensor -- including every module that
   shares it (the tied ``lm_head``).
4. **Read-back** (:meth:`ServedWeights.readback`): ask the kernels themselves what they
   compute with: a linear layer times one-hot inputs returns columns of its weight
   exactly; an embedding returns rows; other parameters are read directly. The caller
   compares these bits with the published version at the changed positions.
5. **Revert** (:meth:`ServedWeights.revert`): put back what the last apply overwrote.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from services.rollout import rpc_arrays
from services.rollout.weight_layout import LayoutError, Run, WeightLayout

log = logging.getLogger(__name__)

#: Columns (or rows) read back per touched module: the ones with the most changes, plus one
#: that rotates through the tensor so unchanged regions are covered over time.
READBACK_PICKS = 2

_NUMPY_BITS = {"bf16": np.uint16, "fp16": np.uint16, "fp32": np.uint32}


def _torch_dtypes() -> dict[str, Any]:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _int_view(dtype: Any) -> Any:
    import torch

    return {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]


def _dtype_name(dtype: Any) -> str:
    names = {v: k for k, v in _torch_dtypes().items()}
    if dtype not in names:
        raise LayoutError(f"engine tensor dtype {dtype} is not bf16, fp16 or fp32")
    return names[dtype]


def flat_bits(tensor: Any) -> Any:
    """A 1-D integer view of ``tensor``'s storage (writes go through)."""
    return tensor.data.view(-1).view(_int_view(tensor.dtype))


def to_numpy_bits(tensor: Any) -> np.ndarray:
    """Raw bits of a torch tensor as the unsigned numpy array weightsync uses."""
    name = _dtype_name(tensor.dtype)
    return tensor.detach().to("cpu").contiguous().view(-1).view(_int_view(tensor.dtype)).numpy().view(_NUMPY_BITS[name])


def engine_values(bits: np.ndarray, checkpoint_dtype: str, engine_dtype: Any, device: Any) -> Any:
    """Checkpoint raw bits as the engine tensor's integer view (converting the dtype if the
    engine runs another precision than the checkpoint)."""
    import torch

    signed = {np.uint16: np.int16, np.uint32: np.int32}[_NUMPY_BITS[checkpoint_dtype]]
    array = np.ascontiguousarray(bits)
    values = torch.from_numpy((array if array.flags.writeable else array.copy()).view(signed))
    source = _torch_dtypes()[checkpoint_dtype]
    if source != engine_dtype:
        values = values.view(source).to(engine_dtype).view(_int_view(engine_dtype))
    return values.to(device, non_blocking=True)


@dataclasses.dataclass
class Target:
    """One engine tensor: its logical values and the modules that compute with it."""

    name: str
    logical: Any  # torch tensor in loader format
    live: bool  # the engine computes with ``logical`` itself (no packed copy)
    owner: tuple[str, str]  # (module path, parameter name)
    users: list[tuple[str, str]]  # every (module path, parameter name) computing with it


@dataclasses.dataclass
class Sample:
    """Bits an engine tensor holds at some positions, as the kernels computed them."""

    target: str
    positions: np.ndarray
    bits: np.ndarray
    dtype: str
    via: str  # module path that computed them

    def as_plain(self) -> tuple[str, rpc_arrays.Packed, rpc_arrays.Packed, str, str]:
        return self.target, rpc_arrays.pack_positions(self.positions), rpc_arrays.pack(self.bits), self.dtype, self.via

    @classmethod
    def from_plain(cls, plain: Any) -> Sample:
        target, positions, bits, dtype, via = plain
        return cls(target, rpc_arrays.unpack_positions(positions), rpc_arrays.unpack(bits), dtype, via)


class ServedWeights:
    """The weights one vLLM worker serves, with element-level in-place updates."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.layout: WeightLayout | None = None
        self.targets: dict[str, Target] = {}
        self._undo: list[tuple[str, Any, Any]] = []  # (target, positions tensor | slice, old values)
        self._touched: set[str] = set()
        self._rotation = 0

    # ------------------------------------------------------------ set-up

    def prepare(self, checkpoint: Mapping[str, tuple[str, tuple[int, ...]]], files: list[str]) -> WeightLayout:
        """Discovers the layout, builds the logical tensors and fills the packed-away ones
        from the checkpoint ``files`` (what the engine loaded). Raises LayoutError when
        this engine's loader does something element updates cannot follow."""
        layout, templates = discover_layout(self.model, checkpoint)
        modules = dict(self.model.named_modules(remove_duplicate=False))
        users = _parameter_users(self.model)
        for name, template in templates.items():
            module_path, pname = name.rpartition(".")[::2]
            live = modules[module_path]._parameters.get(pname)
            if live is not None and tuple(live.shape) == tuple(template.shape) and live.dtype == template.dtype:
                logical, is_live = live, True
            else:
                logical, is_live = _materialize(template, live.device if live is not None else None), False
            self.targets[name] = Target(name, logical, is_live, (module_path, pname), users.get(id(live), [(module_path, pname)]))
        self._fill_from_files(layout, files)
        self.layout = layout
        return layout

    def _fill_from_files(self, layout: WeightLayout, files: list[str]) -> None:
        from safetensors import safe_open

        shadow = {t for t, target in self.targets.items() if not target.live}
        for path in files:
            with safe_open(path, framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                    runs = [r for r in layout.runs.get(name, []) if r.target in shadow]
                    if not runs:
                        continue
                    tensor = fh.get_tensor(name)
                    for r in runs:
                        dst = self.targets[r.target].logical
                        src = tensor.reshape(-1)[r.src_start : r.src_start + r.length].to(dst.dtype)
                        dst.data.view(-1)[r.dst_start : r.dst_start + r.length].copy_(src)

    # ------------------------------------------------------------ updates

    def apply(self, changes: Mapping[str, Any], verify: Mapping[str, Any]) -> dict[str, Any]:
        """Writes the changed elements (``ChangeSet.as_plain()``), re-processes every module
        that computes with a touched tensor, and returns what the kernels now compute with
        around the positions the caller expects changed (``verify``: engine tensor ->
        packed positions, worked out by the caller, not from what was written here).
        Call :meth:`commit` or :meth:`revert` next."""
        layout = self._layout()
        if self._undo:
            raise RuntimeError("an applied update is neither committed nor reverted")
        t0 = time.perf_counter()
        meta: Mapping[str, tuple[str, list[int]]] = changes["meta"]
        touched: set[str] = set()
        elements = 0
        for name, packed in changes["sparse"].items():
            positions, values = rpc_arrays.unpack_positions(packed[0]), rpc_arrays.unpack(packed[1])
            self._check_shape(name, meta[name])
            for placed in layout.place(name, positions):
                self._write_sparse(placed.target, placed.positions, values[placed.index], meta[name][0])
                touched.add(placed.target)
                elements += placed.positions.shape[0]
        for name, packed in changes["dense"].items():
            values = rpc_arrays.unpack(packed)
            self._check_shape(name, meta[name])
            for target, dst, offset, length in layout.place_range(name, 0, values.shape[0]):
                self._write_dense(target, dst, values[offset : offset + length], meta[name][0])
                touched.add(target)
                elements += length
        t1 = time.perf_counter()
        self._touched = touched
        modules = self._reprocess(touched)
        t2 = time.perf_counter()
        samples = self.readback({t: rpc_arrays.unpack_positions(p) for t, p in verify.items()})
        t3 = time.perf_counter()
        return {
            "samples": [s.as_plain() for s in samples],
            "elements": elements,
            "modules": modules,
            "write_ms": (t1 - t0) * 1e3,
            "process_ms": (t2 - t1) * 1e3,
            "readback_ms": (t3 - t2) * 1e3,
        }

    def commit(self) -> None:
        """Forgets how to undo the last apply (it is being served)."""
        self._undo, self._touched = [], set()

    def revert(self) -> dict[str, Any]:
        """Puts back what the last apply overwrote, re-processes the same modules, and
        checks the kernels against the logical tensors again."""
        for target, where, old in reversed(self._undo):
            flat_bits(self.targets[target].logical)[where] = old
        touched, self._undo = self._touched, []
        self._reprocess(touched)
        self._touched = set()
        return {"mismatches": self.self_check(touched)}

    def self_check(self, targets: set[str] | None = None) -> int:
        """Read-back of ``targets`` (default all) compared with the logical tensors: how
        many elements the kernels compute with differ from what this worker holds."""
        names = targets if targets is not None else set(self.targets)
        samples = self.readback({t: np.zeros(0, dtype=np.int64) for t in names})
        mismatches = 0
        for s in samples:
            logical = self.targets[s.target].logical
            held = flat_bits(logical)[_index(s.positions, logical.device)].cpu().numpy().view(_NUMPY_BITS[s.dtype])
            mismatches += int(np.count_nonzero(held != s.bits))
        return mismatches

    def _layout(self) -> WeightLayout:
        if self.layout is None:
            raise RuntimeError("prepare() first")
        return self.layout

    def _check_shape(self, name: str, meta: tuple[str, list[int]]) -> None:
        layout = self._layout()
        if name not in layout.runs:
            raise LayoutError(f"update names tensor {name!r}, which the engine does not have")
        numel = math.prod(meta[1])
        have = sum(r.length for r in layout.runs[name])
        if numel != have:
            raise LayoutError(f"update's {name} has {numel} elements, the engine's {have}")

    def _write_sparse(self, target: str, positions: np.ndarray, values: np.ndarray, dtype: str) -> None:
        logical = self.targets[target].logical
        flat = flat_bits(logical)
        where = _index(positions, logical.device)
        self._undo.append((target, where, flat[where].clone()))
        flat[where] = engine_values(values, dtype, logical.dtype, logical.device)

    def _write_dense(self, target: str, dst: int, values: np.ndarray, dtype: str) -> None:
        logical = self.targets[target].logical
        flat = flat_bits(logical)
        where = slice(dst, dst + values.shape[0])
        self._undo.append((target, where, flat[where].clone()))
        flat[where] = engine_values(values, dtype, logical.dtype, logical.device)

    def _reprocess(self, targets: set[str]) -> int:
        """Re-runs the backend's post-load processing for every module computing with a
        touched tensor, each with its logical tensors installed first. Returns how many.

        A module the CPU backend packs is re-packed on its next use (which the read-back
        makes right away for every module that computes with the weight as a matrix):
        a packed copy that nothing computes with -- the embedding's own matmul handle
        when a separate, tied ``lm_head`` does the output projection -- costs nothing."""
        modules = dict(self.model.named_modules(remove_duplicate=False))
        paths = sorted({path for t in targets for path, _ in self.targets[t].users})
        own = {target.owner: target for target in self.targets.values()}
        for path in paths:
            module = modules[path]
            for pname in list(module._parameters):
                target = own.get((path, pname))
                if target is not None and not target.live:
                    module._parameters[pname] = target.logical
            method = getattr(module, "quant_method", None)
            if method is None or not hasattr(method, "process_weights_after_loading"):
                continue
            if callable(getattr(module, "cpu_linear", None)):
                module.cpu_linear = _RepackOnUse(module)
            else:
                method.process_weights_after_loading(module)
        return len(paths)

    # ------------------------------------------------------------ read-back

    def readback(self, changed: Mapping[str, np.ndarray]) -> list[Sample]:
        """What the kernels compute with, for each tensor in ``changed``: through every
        module using it, at the columns (rows) holding the most changed positions plus a
        rotating one; other parameters at the changed positions themselves."""
        import torch

        modules = dict(self.model.named_modules(remove_duplicate=False))
        samples: list[Sample] = []
        self._rotation += 1
        with torch.no_grad():
            for name, positions in changed.items():
                target = self.targets[name]
                for path, pname in target.users:
                    samples.extend(self._read_through(modules[path], path, pname, target, positions))
        return samples

    def _read_through(self, module: Any, path: str, pname: str, target: Target, positions: np.ndarray) -> Iterator[Sample]:
        import torch

        logical = target.logical
        dtype = _dtype_name(logical.dtype)
        kind = _module_kind(module, pname, logical)
        if kind == "direct":
            live = module._parameters[pname]
            picks = positions if positions.size else np.arange(min(logical.numel(), 64), dtype=np.int64)
            picks = picks[:4096]
            got = live.data.view(-1)[_index(picks, live.device)].to(logical.dtype)
            yield Sample(target.name, picks, to_numpy_bits(got), dtype, path)
            return
        rows, cols = logical.shape
        axis_len = cols if kind == "columns" else rows
        along = positions % cols if kind == "columns" else positions // cols
        picks = _picks(along, axis_len, self._rotation)
        index = torch.as_tensor(picks, device=logical.device)
        if kind == "columns":
            x = torch.zeros(len(picks), cols, dtype=logical.dtype, device=logical.device)
            x[torch.arange(len(picks), device=logical.device), index] = 1
            y = module.quant_method.apply(module, x)[:, :rows].to(logical.dtype)
            flat = np.arange(rows, dtype=np.int64)[None, :] * cols + picks[:, None]
            keep = _verifiable_through_matmul(y, logical)
            yield Sample(target.name, flat[keep.cpu().numpy()], to_numpy_bits(y[keep]), dtype, path)
        else:
            y = module.quant_method.embedding(module, index)[:, :cols].to(logical.dtype)
            flat = (picks[:, None] * cols + np.arange(cols, dtype=np.int64)[None, :]).reshape(-1)
            yield Sample(target.name, flat, to_numpy_bits(y), dtype, path)


class _RepackOnUse:
    """Stands in for a module's packed matmul until it is first called: then runs the
    backend's post-load processing (which installs the freshly packed one) and computes."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def __call__(self, x: Any, weight: Any, bias: Any) -> Any:
        module = self.module
        module.quant_method.process_weights_after_loading(module)
        return module.cpu_linear(x, module.weight, bias)


def _verifiable_through_matmul(y: Any, logical: Any) -> Any:
    """Mask of read-back outputs that show one weight: a row holding an infinity or NaN
    elsewhere turns every one-hot product into NaN (0 * inf), so such rows say nothing
    about the picked column and are left out (checked only where a NaN came back)."""
    import torch

    keep = torch.ones_like(y, dtype=torch.bool)
    suspect = torch.nonzero(torch.isnan(y).any(dim=0)).flatten()
    for row in suspect.tolist():
        if not bool(torch.isfinite(logical[row]).all()):
            keep[:, row] = False
    return keep


def _picks(along: np.ndarray, size: int, rotation: int) -> np.ndarray:
    """The columns (rows) to read back: most changed first, plus a rotating one."""
    chosen: list[int] = []
    if along.size:
        counts = np.bincount(along, minlength=size)
        chosen = [int(i) for i in np.argsort(counts)[::-1][:READBACK_PICKS] if counts[i] > 0]
    extra = (rotation * 7919) % size
    if extra not in chosen:
        chosen.append(extra)
    return np.array(chosen, dtype=np.int64)


def _module_kind(module: Any, pname: str, logical: Any) -> str:
    """How to ask ``module`` what it computes with: 'columns' (a linear layer times one-hot
    inputs), 'rows' (an embedding lookup) or 'direct' (the parameter is used as it is)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    if pname != "weight" or logical.dim() != 2:
        return "direct"
    if isinstance(module, (LinearBase, ParallelLMHead)):
        return "columns"
    if isinstance(module, VocabParallelEmbedding):
        return "rows"
    return "direct"


def _index(positions: np.ndarray, device: Any) -> Any:
    import torch

    return torch.as_tensor(positions, dtype=torch.int64, device=device)


def _materialize(template: Any, device: Any) -> Any:
    """A real tensor shaped like a loader-format template, keeping its class and attributes
    (the weight loader and partition metadata vLLM's post-processing may read)."""
    import torch

    tensor = torch.empty(tuple(template.shape), dtype=template.dtype, device=device or "cpu")
    tensor.__class__ = template.__class__
    tensor.__dict__ = template.__dict__.copy()
    return tensor


def _parameter_users(model: Any) -> dict[int, list[tuple[str, str]]]:
    """id(parameter) -> every (module path, name) holding that very parameter (ties)."""
    users: dict[int, list[tuple[str, str]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for pname, param in module._parameters.items():
            if param is not None:
                users.setdefault(id(param), []).append((path, pname))
    return users


def discover_layout(model: Any, checkpoint: Mapping[str, tuple[str, tuple[int, ...]]]) -> tuple[WeightLayout, dict[str, Any]]:
    """Runs the model's own ``load_weights`` on meta tensors and records every copy it
    makes: which checkpoint elements land in which engine tensor. Returns the layout and,
    per engine tensor that received elements, its loader-format template (meta)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs, sanitize_layer_refs
    except ImportError as exc:  # another vLLM: no loader-format metadata to work from
        raise LayoutError(f"this vLLM keeps no loader-format metadata ({exc})") from None

    copies: list[tuple[Any, Any]] = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.ops.aten.copy_.default:
                copies.append((args[0], args[1]))
            return func(*args, **(kwargs or {}))

    dtypes = _torch_dtypes()
    saved: list[tuple[Any, str, Any]] = []
    templates: dict[int, tuple[str, Any]] = {}
    sources: dict[int, str] = {}
    try:
        for path, module in model.named_modules():
            info = LAYERWISE_INFO.get(module)
            if info is None:
                continue
            for pname, meta in info.restore_metadata[0].items():
                if pname in module._parameters:
                    saved.append((module, pname, module._parameters[pname]))
                    module._parameters[pname] = restore_layer_refs(meta, module)
                    templates[meta.untyped_storage()._cdata] = (f"{path}.{pname}" if path else pname, meta)
        inputs = []
        for name, (dtype, shape) in checkpoint.items():
            t = torch.empty(tuple(shape), dtype=dtypes[dtype], device="meta")
            sources[t.untyped_storage()._cdata] = name
            inputs.append((name, t))
        with Recorder():
            model.load_weights(iter(inputs))
    except LayoutError:
        raise
    except Exception as exc:  # noqa: BLE001 - any loader failure means: not followable
        raise LayoutError(f"the engine's loader failed on meta tensors: {type(exc).__name__}: {exc}") from None
    finally:
        for module, pname, param in saved:
            sanitize_layer_refs(module._parameters[pname], module)
            module._parameters[pname] = param
    runs: dict[str, list[Run]] = {}
    used: dict[str, Any] = {}
    for dst, src in copies:
        target = templates.get(dst.untyped_storage()._cdata)
        name = sources.get(src.untyped_storage()._cdata)
        if target is None or name is None:
            continue  # a copy between temporaries, not checkpoint -> engine
        if not (dst.is_contiguous() and src.is_contiguous()) or dst.numel() != src.numel():
            raise LayoutError(f"{name} -> {target[0]}: the loader copies a strided view (sharded or transposed)")
        runs.setdefault(name, []).append(Run(target[0], src.storage_offset(), dst.storage_offset(), dst.numel()))
        used[target[0]] = target[1]
    layout = WeightLayout(runs, {t: tuple(m.shape) for t, m in used.items()})
    layout.validate({n: tuple(s) for n, (_, s) in checkpoint.items()})
    return layout, used
