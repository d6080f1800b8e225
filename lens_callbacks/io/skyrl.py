"""Read a SkyRL training-batch dump without SkyRL, and without running anything it names.

SkyRL writes ``{export_path}/dumped_data/global_step_{N}_training_input.pkl`` when
``trainer.dump_data_batch=true`` (a config boolean; the function is ``dump_data``): a plain pickle of
its ``TrainingInputBatch``, a dict subclass of tensors. ``rewards`` and ``metadata["uids"]`` are popped
five lines before the dump, so the file holds neither the reward a row came from nor the group it
belongs to. :func:`read_skyrl_dump` recovers what does reach disk:

- through a :class:`pickle.Unpickler` whose ``find_class`` allows only the globals SkyRL's own ``save``
  writes, each mapped to a local stand-in (``torch.storage._load_from_bytes`` never resolves to the real
  function: it would ``torch.load(..., weights_only=False)`` embedded bytes). Anything else raises
  :class:`ForbiddenGlobalError` naming the global and the file, at ``find_class`` time, before any batch
  is returned;
- decoding every tensor from its bytes with numpy (a ``torch.save`` zip payload, e.g. the bfloat16
  ``rollout_logprobs``, goes through a second restricted unpickler with ``persistent_load``);
- dropping the last ``metadata["pad_size"]`` padding rows;
- grouping rows by ``metadata["policy_prompt_boundaries"]`` when present, else by their prompt tokens,
  extracted for the padding layout detected from the masks (``"current"``: left padding only, response
  right-aligned; ``"legacy"``: prompt left-padded, response right-padded).

A truncated or corrupt file raises :class:`SkyRLDumpError` naming the file; a partial batch is never
returned. Both errors subclass :class:`pickle.UnpicklingError`.
"""

from __future__ import annotations

import collections
import functools
import io
import os
import pickle
import re
import zipfile
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

import numpy as np
import torch

__all__ = [
    "SkyRLDump",
    "SkyRLDumpError",
    "ForbiddenGlobalError",
    "read_skyrl_dump",
    "ALLOWED_GLOBALS",
]

PathLike = Union[str, "os.PathLike[str]"]

_STEP_RE = re.compile(r"global_step_(\d+)_training_input\.pkl$")


class SkyRLDumpError(pickle.UnpicklingError):
    """A SkyRL dump that cannot be read (truncated, corrupt, or not a training batch); names the file."""


class ForbiddenGlobalError(SkyRLDumpError):
    """The dump names a global outside the allow-list; nothing it names is imported or called."""

    def __init__(self, module: str, name: str, path: str, allowed: Optional[Iterable[str]] = None) -> None:
        self.module = module
        self.name = name
        self.path = path
        names = ", ".join(sorted(ALLOWED_GLOBALS if allowed is None else allowed))
        super().__init__(
            f"{path}: refused to unpickle the global {module}.{name}: it is not one that SkyRL's "
            f"TrainingInputBatch.save writes (allowed here: {names}). "
            "Nothing was imported or called; read only dumps you trust with pickle itself."
        )


# ---------------------------------------------------------------------------------------------
# Stand-ins. Each allowed global resolves to one of these, never to the object it names.


class _TrainingInputBatch(dict):
    """Stands in for SkyRL's ``TrainingInputBatch`` (a dict subclass with ``__getstate__``)."""

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _rebuild_tensor_batch(cls: Any, state: Any) -> Any:
    # SkyRL's own version builds a TrainingInputBatch from `state`; the state is all a reader needs.
    return state


def _inert(*args: Any, **kwargs: Any) -> None:
    # Legacy files store every tensor twice; the raw torch copy is ignored, the BUILD state is read.
    return None


def _device(*args: Any) -> str:
    return ":".join(str(a) for a in args)


class _OrderedDict(collections.OrderedDict):
    pass


_OUTER_GLOBALS: dict[tuple[str, str], Callable[..., Any]] = {
    ("skyrl.backends.skyrl_train.training_batch", "_rebuild_tensor_batch"): _rebuild_tensor_batch,
    ("skyrl.backends.skyrl_train.training_batch", "TrainingInputBatch"): _TrainingInputBatch,
    ("skyrl_train.training_batch", "TrainingInputBatch"): _TrainingInputBatch,
    ("torch._utils", "_rebuild_tensor_v2"): _inert,
    ("torch.storage", "_load_from_bytes"): _inert,
    ("collections", "OrderedDict"): _OrderedDict,
    ("torch", "device"): _device,
}

#: Every global a dump may name (module, name). Anything else is refused.
ALLOWED_GLOBALS = frozenset(f"{m}.{n}" for m, n in _OUTER_GLOBALS)


class _Storage:
    """A typed storage stand-in: a numpy dtype, with the torch dtype the tensor is returned in."""

    def __init__(self, name: str, np_dtype: str, torch_dtype: torch.dtype) -> None:
        self.name, self.np_dtype, self.torch_dtype = name, np.dtype(np_dtype), torch_dtype


_STORAGES = {
    "BFloat16Storage": _Storage("BFloat16Storage", "<u2", torch.bfloat16),
    "HalfStorage": _Storage("HalfStorage", "<f2", torch.float16),
    "FloatStorage": _Storage("FloatStorage", "<f4", torch.float32),
    "DoubleStorage": _Storage("DoubleStorage", "<f8", torch.float64),
    "LongStorage": _Storage("LongStorage", "<i8", torch.int64),
    "IntStorage": _Storage("IntStorage", "<i4", torch.int32),
    "ShortStorage": _Storage("ShortStorage", "<i2", torch.int16),
    "CharStorage": _Storage("CharStorage", "<i1", torch.int8),
    "ByteStorage": _Storage("ByteStorage", "<u1", torch.uint8),
    "BoolStorage": _Storage("BoolStorage", "<u1", torch.bool),
}


_INNER_ALLOWED = ["torch._utils._rebuild_tensor_v2", "collections.OrderedDict", *(f"torch.{n}" for n in _STORAGES)]


@dataclass
class _Tensor:
    """A decoded tensor payload: a numpy array plus the torch dtype it stands for."""

    array: np.ndarray
    torch_dtype: torch.dtype


class _OuterUnpickler(pickle.Unpickler):
    def __init__(self, f: io.BufferedIOBase, path: str) -> None:
        super().__init__(f)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _OUTER_GLOBALS:
            raise ForbiddenGlobalError(module, name, self._path)
        # A fresh stand-in per read: BUILD can set attributes on what find_class returns, and that must
        # not reach the module-level objects the next read uses.
        obj = _OUTER_GLOBALS[(module, name)]
        if isinstance(obj, type):
            return type(obj.__name__, (obj,), {})
        return functools.partial(obj)

    def persistent_load(self, pid: Any) -> Any:
        raise SkyRLDumpError(f"{self._path}: unexpected persistent id {pid!r} in the outer pickle.")


class _ZipTensorUnpickler(pickle.Unpickler):
    """The ``data.pkl`` of a ``torch.save`` zip: ``_rebuild_tensor_v2(storage, offset, size, stride, ...)``."""

    def __init__(self, f: io.BufferedIOBase, path: str, load_record: Callable[[str], bytes]) -> None:
        super().__init__(f)
        self._path = path
        self._load_record = load_record

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return functools.partial(_rebuild_tensor_from_storage)
        if (module, name) == ("collections", "OrderedDict"):
            return type("OrderedDict", (_OrderedDict,), {})
        if module == "torch" and name in _STORAGES:
            st = _STORAGES[name]
            return _Storage(st.name, st.np_dtype.str, st.torch_dtype)
        raise ForbiddenGlobalError(module, name, self._path + " (embedded torch.save payload)", _INNER_ALLOWED)

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Storage)):
            raise SkyRLDumpError(f"{self._path}: unexpected persistent id {pid!r} in an embedded torch.save payload.")
        _, storage, key, _location, numel = pid
        raw = self._load_record(str(key))
        arr = np.frombuffer(raw, dtype=storage.np_dtype)
        if arr.size != int(numel):
            raise SkyRLDumpError(f"{self._path}: storage {key!r} holds {arr.size} elements, expected {numel}.")
        return (arr, storage)


def _rebuild_tensor_from_storage(storage: Any, offset: int, size: Any, stride: Any, *rest: Any) -> _Tensor:
    arr, st = storage
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    if len(size) != len(stride) or any(s < 0 for s in size) or any(s < 0 for s in stride):
        raise ValueError(f"bad size/stride {size}/{stride}")
    span = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1 if all(size) else 0
    if offset < 0 or span > arr.size:
        raise ValueError(f"tensor view {size}/{stride} at offset {offset} exceeds its storage of {arr.size}")
    item = arr.itemsize
    view = np.lib.stride_tricks.as_strided(
        arr[offset:], shape=size, strides=tuple(s * item for s in stride), writeable=False
    )
    return _Tensor(np.ascontiguousarray(view), st.torch_dtype)


def _decode_torch_zip(data: bytes, path: str) -> _Tensor:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        names = zf.namelist()
        pkl = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise SkyRLDumpError(f"{path}: embedded torch.save payload has {len(pkl)} data.pkl members, expected 1.")
        prefix = pkl[0][: -len("data.pkl")]
        order = "little"
        if prefix + "byteorder" in names:
            order = zf.read(prefix + "byteorder").decode().strip()
        if order != "little":
            raise SkyRLDumpError(f"{path}: embedded torch.save payload is {order}-endian; only little-endian is read.")
        out = _ZipTensorUnpickler(io.BytesIO(zf.read(pkl[0])), path, lambda key: zf.read(f"{prefix}data/{key}")).load()
    if not isinstance(out, _Tensor):
        raise SkyRLDumpError(f"{path}: embedded torch.save payload is a {type(out).__name__}, expected one tensor.")
    return out


def _decode_entry(key: str, entry: Any, path: str) -> Any:
    """One ``batch_dict`` value → ``_Tensor``, a list of them (``tensor_list``), or None."""
    if entry is None:
        return None
    if isinstance(entry, (bytes, bytearray)):
        if zipfile.is_zipfile(io.BytesIO(entry)):
            return _decode_torch_zip(bytes(entry), path)
        raise SkyRLDumpError(
            f"{path}: `{key}` is a raw legacy (non-zip) torch.save stream (dumps before 2026-01-28); "
            "it is not read, because decoding it safely needs torch's legacy loader."
        )
    if not isinstance(entry, dict) or "format" not in entry:
        raise SkyRLDumpError(f"{path}: `{key}` is a {type(entry).__name__}, expected a {{'format': ...}} entry or None.")
    fmt = entry["format"]
    if fmt == "numpy":
        dtype = np.dtype(str(entry["dtype"]))
        if dtype.kind not in "biuf":
            raise SkyRLDumpError(f"{path}: `{key}` has dtype {dtype}, expected a numeric dtype.")
        shape = tuple(int(s) for s in entry["shape"])
        arr = np.frombuffer(entry["data"], dtype=dtype.newbyteorder("<")).reshape(shape)
        return _Tensor(arr, _torch_dtype(dtype))
    if fmt == "torch":
        return _decode_torch_zip(entry["data"], path)
    if fmt == "tensor_list":
        return [_decode_entry(key, item, path) for item in entry["items"]]
    raise SkyRLDumpError(f"{path}: `{key}` has format {fmt!r}; expected 'numpy', 'torch' or 'tensor_list'.")


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=dtype.newbyteorder("="))).dtype


def _to_torch(t: _Tensor) -> torch.Tensor:
    arr = np.array(t.array, copy=True)  # own, writable memory: frombuffer views of pickle bytes are read-only
    if t.torch_dtype == torch.bfloat16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    if t.torch_dtype == torch.bool:
        return torch.from_numpy(arr.astype(np.bool_))
    return torch.from_numpy(arr.astype(arr.dtype.newbyteorder("=")))


# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SkyRLDump:
    """One dumped SkyRL training step, padding rows dropped.

    Attributes:
        batch: SkyRL's own key → ``torch.Tensor`` (``[N, ...]``, N real rows; dtypes as stored, bfloat16
            kept as ``torch.bfloat16``), a list of tensors (``tensor_list`` keys), or None.
        metadata: the batch's metadata dict as written (tuples stay tuples).
        groups: row-index lists, one per prompt (GRPO group), in row order.
        step: the global step from the file name (``global_step_{N}_training_input.pkl``), else None.
        layout: ``"current"`` (left padding only; response tensors right-aligned) or ``"legacy"``
            (prompt left-padded, response right-padded; response tensors left-aligned).
        path: the file read.
        pad_size: how many padding rows were dropped.
        group_source: ``"policy_prompt_boundaries"`` or ``"prompt_tokens"``.
    """

    batch: dict[str, Any]
    metadata: dict[str, Any]
    groups: list[list[int]]
    step: Optional[int]
    layout: str
    path: str = ""
    pad_size: int = 0
    group_source: str = ""

    @property
    def n_rows(self) -> int:
        return int(self.batch["sequences"].shape[0])

    @property
    def sequence_width(self) -> int:
        return int(self.batch["sequences"].shape[1])

    @property
    def response_width(self) -> int:
        return int(self.batch["response_mask"].shape[1])

    def group_of_rows(self) -> torch.Tensor:
        """``[N]`` long: the group index of each row."""
        out = torch.full((self.n_rows,), -1, dtype=torch.long)
        for g, rows in enumerate(self.groups):
            out[rows] = g
        return out

    def response_tokens(self) -> torch.Tensor:
        """``[N, R]`` token ids aligned with the response tensors (column j ↔ ``sequences[:, S-R+j]``)."""
        return self.batch["sequences"][:, self.sequence_width - self.response_width :]

    def prompt_tokens(self, row: int) -> list[int]:
        """The prompt token ids of one row, extracted for the detected layout."""
        return _prompt_tokens(self.batch, row, self.layout)

    def trained_tokens(self, row: int) -> list[int]:
        """Token ids at the row's trained positions (``loss_mask == 1``), in order."""
        mask = self.batch["loss_mask"][row] > 0  # [R]
        return [int(x) for x in self.response_tokens()[row][mask].tolist()]

    def advantages_per_row(self) -> torch.Tensor:
        """``[N]`` float64: each row's scalar GRPO advantage (its value on a ``response_mask == 1`` position)."""
        adv = self.batch["advantages"].double()  # [N, R]
        resp = self.batch["response_mask"] > 0  # [N, R]
        first = resp.float().argmax(dim=1)  # [N]
        vals = adv.gather(1, first[:, None]).squeeze(1)
        return torch.where(resp.any(dim=1), vals, torch.zeros_like(vals))

    def masked_logprob_sums(self, key: str = "action_log_probs") -> torch.Tensor:
        """``[N]`` float64: ``(batch[key] * loss_mask).sum(-1)``, the trained log-probability of each row."""
        lp = self.batch[key].double()  # [N, R]
        return (lp * self.batch["loss_mask"].double()).sum(-1)

    def summary(self) -> dict[str, Any]:
        adv = self.advantages_per_row()
        return {
            "path": self.path,
            "step": self.step,
            "layout": self.layout,
            "rows": self.n_rows,
            "pad_size": self.pad_size,
            "groups": len(self.groups),
            "group_source": self.group_source,
            "keys": {k: _describe(v) for k, v in self.batch.items()},
            "advantages_per_group": [[round(float(adv[r]), 6) for r in rows] for rows in self.groups],
        }

    def render(self) -> str:
        """The dump's summary: rows, groups, keys, advantages per group."""
        s = self.summary()
        lines = [
            f"SkyRL dump {os.path.basename(self.path) or '(bytes)'}: step {self.step}, layout {self.layout}",
            f"rows {s['rows']} (after dropping {self.pad_size} padding rows), groups {s['groups']} "
            f"(from {self.group_source}), sequence width {self.sequence_width}, response width {self.response_width}",
            "keys:",
        ]
        w = max(len(k) for k in self.batch)
        for k, d in s["keys"].items():
            lines.append(f"  {k:<{w}}  {d}")
        lines.append("advantages per group:")
        adv = self.advantages_per_row()
        for g, rows in enumerate(self.groups):
            vals = " ".join(f"{float(adv[r]):+.4f}" for r in rows)
            lines.append(f"  group {g} (rows {rows[0]}-{rows[-1]}): {vals}")
        return "\n".join(lines)


def _describe(v: Any) -> str:
    if v is None:
        return "None"
    if isinstance(v, torch.Tensor):
        return f"{list(v.shape)} {str(v.dtype).replace('torch.', '')}"
    if isinstance(v, list):
        return f"list of {len(v)} tensors"
    return type(v).__name__


def read_skyrl_dump(path: PathLike) -> SkyRLDump:
    """Read one SkyRL ``global_step_{N}_training_input.pkl`` without importing skyrl.

    Args:
        path: the dump file.

    Returns:
        A :class:`SkyRLDump` with the padding rows dropped and the prompt groups recovered.

    Raises:
        ForbiddenGlobalError: the file names a global outside :data:`ALLOWED_GLOBALS` (e.g. ``builtins.eval``).
        SkyRLDumpError: the file is truncated, corrupt, or not a SkyRL training batch.
        FileNotFoundError: no such file.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    try:
        obj = _OuterUnpickler(io.BytesIO(data), path).load()
    except SkyRLDumpError:
        raise
    except Exception as err:  # truncation, corrupt opcodes, stand-in misuse: never a partial batch
        raise SkyRLDumpError(f"{path}: not a readable SkyRL dump ({type(err).__name__}: {err}).") from err
    try:
        return _assemble(obj, data, path)
    except SkyRLDumpError:
        raise
    except Exception as err:
        raise SkyRLDumpError(f"{path}: not a readable SkyRL dump ({type(err).__name__}: {err}).") from err


def _assemble(obj: Any, data: bytes, path: str) -> SkyRLDump:
    state = obj.__dict__.get("state") if isinstance(obj, _TrainingInputBatch) else obj
    if not isinstance(state, dict) or not {"batch_dict", "batch_size", "metadata"} <= set(state):
        raise SkyRLDumpError(
            f"{path}: expected a TrainingInputBatch state with batch_dict, batch_size and metadata, "
            f"got {type(state).__name__} with keys {sorted(state)[:8] if isinstance(state, dict) else '-'}."
        )
    size = int(state["batch_size"])
    metadata = dict(state["metadata"] or {})
    pad = int(metadata.get("pad_size", 0) or 0)
    if not 0 <= pad < size:
        raise SkyRLDumpError(f"{path}: metadata pad_size {pad} must lie in 0 .. batch_size - 1 = {size - 1}.")
    n = size - pad
    batch: dict[str, Any] = {}
    for key, entry in dict(state["batch_dict"]).items():
        dec = _decode_entry(key, entry, path)
        if dec is None:
            batch[key] = None
        elif isinstance(dec, list):
            items = [_to_torch(t) for t in dec]
            batch[key] = items[:n] if len(items) == size else items
        else:
            t = _to_torch(dec)
            if t.dim() == 0 or t.shape[0] != size:
                raise SkyRLDumpError(f"{path}: `{key}` has shape {list(t.shape)}; expected batch_size {size} rows.")
            # Padding rows are always the last pad_size rows; their advantages are not zero, so drop by count.
            batch[key] = t[:n].clone()
    for key in ("sequences", "attention_mask", "response_mask", "loss_mask", "advantages"):
        if not isinstance(batch.get(key), torch.Tensor):
            raise SkyRLDumpError(f"{path}: the dump has no `{key}` tensor; it is not a SkyRL training batch.")
    layout = _detect_layout(batch, path)
    groups, source = _groups(batch, metadata, layout, n, path)
    m = _STEP_RE.search(os.path.basename(path))
    return SkyRLDump(
        batch=batch,
        metadata=metadata,
        groups=groups,
        step=int(m.group(1)) if m else None,
        layout=layout,
        path=path,
        pad_size=pad,
        group_source=source,
    )


def _detect_layout(batch: dict[str, Any], path: str) -> str:
    resp = batch["response_mask"] > 0  # [N, R]
    last, first = bool(resp[:, -1].all()), bool(resp[:, 0].all())
    if last:
        # When every response fills the window the two layouts coincide; "current" reads it correctly.
        return "current"
    if first:
        return "legacy"
    raise SkyRLDumpError(
        f"{path}: cannot tell the padding layout from response_mask: neither its last column (current: "
        "left padding only) nor its first column (legacy: response right-padded) is 1 on every row."
    )


def _prompt_tokens(batch: dict[str, Any], row: int, layout: str) -> list[int]:
    seq, att = batch["sequences"][row], batch["attention_mask"][row] > 0  # [S], [S]
    S, R = seq.shape[0], batch["response_mask"].shape[1]
    if layout == "current":
        real = seq[att]
        r = int((batch["response_mask"][row] > 0).sum())
        return [int(x) for x in real[: real.shape[0] - r].tolist()]
    return [int(x) for x in seq[: S - R][att[: S - R]].tolist()]


def _groups(batch: dict[str, Any], metadata: dict[str, Any], layout: str, n: int, path: str) -> tuple[list[list[int]], str]:
    bounds = metadata.get("policy_prompt_boundaries")
    if bounds:
        groups = [list(range(int(a), int(b))) for a, b in bounds]
        covered = [r for g in groups for r in g]
        if covered != list(range(n)):
            raise SkyRLDumpError(
                f"{path}: policy_prompt_boundaries {list(bounds)!r} must cover rows 0 .. {n - 1} in order, once each."
            )
        return groups, "policy_prompt_boundaries"
    # No group ids reach disk (uids are popped): a group is a run of consecutive rows with one prompt.
    groups: list[list[int]] = []
    prev: Optional[tuple[int, ...]] = None
    for row in range(n):
        key = tuple(_prompt_tokens(batch, row, layout))
        if key != prev:
            groups.append([])
            prev = key
        groups[-1].append(row)
    return groups, "prompt_tokens"
