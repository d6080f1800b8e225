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

from .safe import (
    BoundedReadError,
    ReadBudget,
    ReadLimits,
    _one_line,
    check_zip,
    read_regular_file,
    read_zip_member,
    scan_pickle,
    short_repr,
)

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
        shown = f"{module}.{name}"
        if len(shown) > 100 or not shown.isprintable():
            shown = f"<a global name of {len(shown):,} characters>"
        super().__init__(
            f"{path}: refused to unpickle the global {shown}: it is not one that SkyRL's "
            f"TrainingInputBatch.save writes (allowed here: {names}). "
            "Nothing was imported or called; read only dumps you trust with pickle itself."
        )


# ---------------------------------------------------------------------------------------------
# Stand-ins. Each allowed global resolves to one of these, never to the object it names.


class _Sealed(type):
    """The type of the reader's stand-in classes: nothing can be set on one once it exists.

    BUILD applied to a class that ``find_class`` hands out would set its attributes — a ``__del__`` that builds
    another instance whenever one is freed never stops — so a stand-in class takes none (the static scan
    refuses such a stream first; this holds whatever the scan misses)."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise pickle.UnpicklingError(
            f"the stand-in {cls.__name__} takes no attributes (a pickle tried to set {name[:40]!r})"
        )

    def __delattr__(cls, name: str) -> None:
        raise pickle.UnpicklingError(
            f"the stand-in {cls.__name__} takes no attributes (a pickle tried to delete {name[:40]!r})"
        )


class _SealedInstance:
    """Instances of the stand-ins: a special attribute (``__class__``, ``__del__``) cannot be set on one."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("__") and name.endswith("__"):
            raise pickle.UnpicklingError(
                f"a pickle tried to set the special attribute {name[:40]!r} of a {type(self).__name__}"
            )
        object.__setattr__(self, name, value)


class _TrainingInputBatch(_SealedInstance, dict, metaclass=_Sealed):
    """Stands in for SkyRL's ``TrainingInputBatch`` (a dict subclass with ``__getstate__``)."""

    def __setstate__(self, state: Any) -> None:
        object.__setattr__(self, "state", state)


def _rebuild_tensor_batch(cls: Any, state: Any) -> Any:
    # SkyRL's own version builds a TrainingInputBatch from `state`; the state is all a reader needs.
    return state


def _inert(*args: Any, **kwargs: Any) -> None:
    # Legacy files store every tensor twice; the raw torch copy is ignored, the BUILD state is read.
    return None


_DEVICE_TYPE = re.compile(r"^[a-z_]{1,16}(:[0-9]{1,4})?$")


def _device(*args: Any) -> str:
    # torch.device("cuda", 0) or torch.device("cuda:0"): a short name and a small index, never stringified otherwise
    # (str() of a 1 MiB byte string referenced 600 times would allocate gigabytes).
    ok = 1 <= len(args) <= 2 and isinstance(args[0], str) and _DEVICE_TYPE.match(args[0]) is not None
    if ok and len(args) == 2:
        ok = type(args[1]) is int and 0 <= args[1] < 10_000
    if not ok:
        raise ValueError(
            "a torch.device in the dump is not (device type, index): its arguments are "
            f"{', '.join(type(a).__name__ for a in args[:4])}{', ...' if len(args) > 4 else ''}"
        )
    return ":".join(str(a) for a in args)


class _OrderedDict(_SealedInstance, collections.OrderedDict, metaclass=_Sealed):
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
        # Sealed classes (nothing can be set on them) and a fresh partial per read for functions: BUILD never
        # reaches an object the reader runs, nor the module-level ones the next read uses.
        obj = _OUTER_GLOBALS[(module, name)]
        if isinstance(obj, type):
            return obj
        return functools.partial(obj)

    def persistent_load(self, pid: Any) -> Any:
        raise SkyRLDumpError(f"{self._path}: unexpected persistent id (a {type(pid).__name__}) in the outer pickle.")


class _ZipTensorUnpickler(pickle.Unpickler):
    """The ``data.pkl`` of a ``torch.save`` zip: ``_rebuild_tensor_v2(storage, offset, size, stride, ...)``."""

    def __init__(
        self, f: io.BufferedIOBase, path: str, load_record: Callable[[str], bytes], budget: ReadBudget, key: str
    ) -> None:
        super().__init__(f)
        self._path = path
        self._load_record = load_record
        self._budget = budget
        self._key = key

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return functools.partial(_rebuild_tensor_from_storage, budget=self._budget, key=self._key, path=self._path)
        if (module, name) == ("collections", "OrderedDict"):
            return _OrderedDict
        if module == "torch" and name in _STORAGES:
            st = _STORAGES[name]
            return _Storage(st.name, st.np_dtype.str, st.torch_dtype)
        raise ForbiddenGlobalError(module, name, self._path + " (embedded torch.save payload)", _INNER_ALLOWED)

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Storage)):
            raise SkyRLDumpError(
                f"{self._path}: `{self._key}`: unexpected persistent id (a {type(pid).__name__}) in an embedded "
                "torch.save payload."
            )
        _, storage, key, _location, numel = pid
        if not isinstance(key, str) or not isinstance(numel, int) or numel < 0:
            raise SkyRLDumpError(
                f"{self._path}: `{self._key}`: the storage key (a {type(key).__name__}) and element count (a "
                f"{type(numel).__name__}) must be a str and an int >= 0."
            )
        # The declared element count is checked against the record's real size before anything is decoded.
        raw = self._load_record(key)
        if len(raw) % storage.np_dtype.itemsize:
            raise SkyRLDumpError(
                f"{self._path}: `{self._key}`: storage {_short(key, 40)} holds {len(raw)} bytes, not a whole number of "
                f"{storage.np_dtype.itemsize}-byte elements."
            )
        arr = np.frombuffer(raw, dtype=storage.np_dtype)
        if arr.size != int(numel):
            raise SkyRLDumpError(
                f"{self._path}: `{self._key}`: storage {_short(key, 40)} holds {arr.size} elements, expected {numel}."
            )
        return (arr, storage)


def _ints(v: Any, what: str) -> tuple[int, ...]:
    if (
        not isinstance(v, (tuple, list))
        or len(v) > 8
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    ):
        raise ValueError(f"{what} must be a tuple of at most 8 ints, got {_short(v)}")
    return tuple(v)


def _short(v: Any, limit: int = 120) -> str:
    return short_repr(v, limit)


def _rebuild_tensor_from_storage(
    storage: Any, offset: Any, size: Any, stride: Any, *rest: Any, budget: ReadBudget, key: str, path: str = ""
) -> _Tensor:
    try:
        return _rebuild_checked(storage, offset, size, stride, budget, key)
    except ValueError as err:
        if isinstance(err, BoundedReadError):
            raise
        raise SkyRLDumpError(f"{path}: {err}.") from None


def _rebuild_checked(storage: Any, offset: Any, size: Any, stride: Any, budget: ReadBudget, key: str) -> _Tensor:
    if not (isinstance(storage, tuple) and len(storage) == 2 and isinstance(storage[0], np.ndarray)):
        raise ValueError(f"`{key}`: _rebuild_tensor_v2 got {type(storage).__name__} where a storage belongs")
    arr, st = storage
    size, stride = _ints(size, f"`{key}` size"), _ints(stride, f"`{key}` stride")
    if not isinstance(offset, int) or isinstance(offset, bool):
        raise ValueError(f"`{key}` storage offset must be an int, got {_short(offset)}")
    if len(size) != len(stride) or any(s < 0 for s in size) or any(s < 0 for s in stride):
        raise ValueError(f"`{key}` has a bad size/stride {size}/{stride}")
    if any(st_ == 0 and n > 1 for n, st_ in zip(size, stride)):
        raise ValueError(
            f"`{key}` has stride 0 in size/stride {size}/{stride}: it repeats one element, which a "
            "torch.save of a real batch does not write, and its copy would need memory the file does not hold"
        )
    span = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1 if all(size) else 0
    if offset < 0 or span > arr.size:
        raise ValueError(f"`{key}` tensor view {size}/{stride} at offset {offset} exceeds its storage of {arr.size}")
    numel = int(np.prod(size, dtype=object)) if size else 1
    if numel > arr.size:
        raise ValueError(f"`{key}` views {numel} elements of a storage of {arr.size}: its strides overlap")
    budget.charge(numel * arr.itemsize, f"`{key}` (a tensor of shape {list(size)})")
    item = arr.itemsize
    view = np.lib.stride_tricks.as_strided(
        arr[offset:], shape=size, strides=tuple(s * item for s in stride), writeable=False
    )
    return _Tensor(np.ascontiguousarray(view), st.torch_dtype)


def _decode_torch_zip(data: Any, path: str, budget: ReadBudget, key: str) -> _Tensor:
    if not isinstance(data, (bytes, bytearray)):
        raise SkyRLDumpError(f"{path}: `{key}` data must be bytes, got {type(data).__name__}.")
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as zf:
        check_zip(zf, path, len(data), budget.limits, f"`{key}` torch.save payload", stored_only=False, raw=data)
        names = zf.namelist()
        pkl = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise SkyRLDumpError(f"{path}: embedded torch.save payload has {len(pkl)} data.pkl members, expected 1.")
        prefix = pkl[0][: -len("data.pkl")]
        order = "little"
        what = f"`{key}` torch.save payload"
        if prefix + "byteorder" in names:
            order = read_zip_member(zf, prefix + "byteorder", budget, what).decode(errors="replace").strip()
        if order != "little":
            raise SkyRLDumpError(
                f"{path}: embedded torch.save payload is {_short(order)}-endian; only little-endian is read."
            )
        inner = read_zip_member(zf, pkl[0], budget, what)
        scan_pickle(inner, path, budget.limits, f"{what} data.pkl", budget)

        def load_record(name: str) -> bytes:
            member = f"{prefix}data/{name}"
            if member not in names:
                raise SkyRLDumpError(
                    f"{path}: `{key}`: the torch.save payload has no storage record {_short(name, 40)}."
                )
            return read_zip_member(zf, member, budget, what)

        out = _ZipTensorUnpickler(io.BytesIO(inner), path, load_record, budget, key).load()
    if not isinstance(out, _Tensor):
        raise SkyRLDumpError(f"{path}: embedded torch.save payload is a {type(out).__name__}, expected one tensor.")
    return out


_NUMPY_DTYPES = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64"]
)


def _decode_entry(key: str, entry: Any, path: str, budget: ReadBudget, depth: int = 0) -> Any:
    """One ``batch_dict`` value → ``_Tensor``, a list of them (``tensor_list``), or None."""
    if entry is None:
        return None
    if isinstance(entry, (bytes, bytearray)):
        if zipfile.is_zipfile(io.BytesIO(entry)):
            return _decode_torch_zip(bytes(entry), path, budget, key)
        raise SkyRLDumpError(
            f"{path}: `{key}` is a raw legacy (non-zip) torch.save stream (dumps before 2026-01-28); "
            "it is not read, because decoding it safely needs torch's legacy loader."
        )
    if not isinstance(entry, dict) or "format" not in entry:
        raise SkyRLDumpError(
            f"{path}: `{key}` is a {type(entry).__name__}, expected a {{'format': ...}} entry or None."
        )
    fmt = entry["format"]
    if fmt == "numpy":
        for field in ("data", "shape", "dtype"):
            if field not in entry:
                raise SkyRLDumpError(f"{path}: `{key}` is a numpy entry without its `{field}` field.")
        if not isinstance(entry["dtype"], str) or entry["dtype"] not in _NUMPY_DTYPES:
            raise SkyRLDumpError(
                f"{path}: `{key}` dtype must be one of {sorted(_NUMPY_DTYPES)}, got {_short(entry['dtype'])}."
            )
        dtype = np.dtype(entry["dtype"])
        try:
            shape = _ints(entry["shape"], f"`{key}` shape")
        except ValueError as err:
            raise SkyRLDumpError(f"{path}: {err}.") from None
        data = entry["data"]
        if not isinstance(data, (bytes, bytearray)):
            raise SkyRLDumpError(f"{path}: `{key}` data must be bytes, got {type(data).__name__}.")
        if any(s < 0 for s in shape):
            raise SkyRLDumpError(f"{path}: `{key}` shape {list(shape)} has a negative size.")
        need = int(np.prod(shape, dtype=object)) * dtype.itemsize if shape else dtype.itemsize
        if need != len(data):
            raise SkyRLDumpError(
                f"{path}: `{key}` shape {list(shape)} of {dtype} needs {need:,} bytes; its data holds {len(data):,}."
            )
        # Every decoded array is charged, so one byte string memo-referenced by thousands of entries is refused.
        budget.charge(need, f"`{key}` (an array of shape {list(shape)})")
        arr = np.frombuffer(data, dtype=dtype.newbyteorder("<")).reshape(shape)
        return _Tensor(arr, _torch_dtype(dtype))
    if fmt == "torch":
        return _decode_torch_zip(entry.get("data"), path, budget, key)
    if fmt == "tensor_list":
        items = entry.get("items")
        if not isinstance(items, (list, tuple)) or depth > 0:
            raise SkyRLDumpError(
                f"{path}: `{key}` tensor_list items must be a flat list of entries, got {type(items).__name__}."
            )
        return [_decode_entry(key, item, path, budget, depth + 1) for item in items]
    raise SkyRLDumpError(f"{path}: `{key}` has format {_short(fmt)}; expected 'numpy', 'torch' or 'tensor_list'.")


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


def read_skyrl_dump(path: PathLike, limits: Optional[ReadLimits] = None) -> SkyRLDump:
    """Read one SkyRL ``global_step_{N}_training_input.pkl`` without importing skyrl.

    The read is bounded (:mod:`lens_callbacks.io.safe`): a regular file under the size cap; its opcodes
    scanned before unpickling (memo indices, declared lengths, frames); every decoded array, inflated zip
    member and tensor view charged to a budget of ``budget_factor × file size + budget_floor`` bytes.

    Args:
        path: the dump file.
        limits: the read's limits (default: :meth:`ReadLimits.from_env`).

    Returns:
        A :class:`SkyRLDump` with the padding rows dropped and the prompt groups recovered.

    Raises:
        ForbiddenGlobalError: the file names a global outside :data:`ALLOWED_GLOBALS` (e.g. ``builtins.eval``).
        SkyRLDumpError: the file is truncated, corrupt, not a SkyRL training batch, not a regular file,
            or beyond a limit (the message names the file, the field or the limit).
        FileNotFoundError: no such file.
    """
    path = os.fspath(path)
    try:
        limits = limits or ReadLimits.from_env()
        data = read_regular_file(path, limits, "SkyRL dump")
        budget = limits.budget_for(len(data), path)
        scan_pickle(data, path, limits, "SkyRL dump", budget)
    except BoundedReadError as err:
        raise SkyRLDumpError(str(err)) from None
    try:
        obj = _OuterUnpickler(io.BytesIO(data), path).load()
    except SkyRLDumpError:
        raise
    except BoundedReadError as err:
        raise SkyRLDumpError(str(err)) from None
    except Exception as err:  # truncation, corrupt opcodes, stand-in misuse: never a partial batch
        raise SkyRLDumpError(f"{path}: not a readable SkyRL dump ({type(err).__name__}: {_one_line(err)}).") from err
    try:
        return _assemble(obj, data, path, budget)
    except SkyRLDumpError:
        raise
    except BoundedReadError as err:
        raise SkyRLDumpError(str(err)) from None
    except Exception as err:
        raise SkyRLDumpError(f"{path}: not a readable SkyRL dump ({type(err).__name__}: {_one_line(err)}).") from err


def _assemble(obj: Any, data: bytes, path: str, budget: ReadBudget) -> SkyRLDump:
    state = obj.__dict__.get("state") if isinstance(obj, _TrainingInputBatch) else obj
    if not isinstance(state, dict) or not {"batch_dict", "batch_size", "metadata"} <= set(state):
        raise SkyRLDumpError(
            f"{path}: expected a TrainingInputBatch state with batch_dict, batch_size and metadata, "
            f"got {type(state).__name__} with keys {_short(sorted(map(str, state))[:8]) if isinstance(state, dict) else '-'}."
        )
    size = state["batch_size"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise SkyRLDumpError(f"{path}: `batch_size` must be an int >= 1, got {_short(size)}.")
    if state["metadata"] is not None and not isinstance(state["metadata"], dict):
        raise SkyRLDumpError(f"{path}: `metadata` must be a dict, got {type(state['metadata']).__name__}.")
    if not isinstance(state["batch_dict"], dict):
        raise SkyRLDumpError(f"{path}: `batch_dict` must be a dict, got {type(state['batch_dict']).__name__}.")
    metadata = dict(state["metadata"] or {})
    pad = metadata.get("pad_size", 0) or 0
    if not isinstance(pad, int) or isinstance(pad, bool):
        raise SkyRLDumpError(f"{path}: metadata `pad_size` must be an int, got {_short(pad)}.")
    if not 0 <= pad < size:
        raise SkyRLDumpError(f"{path}: metadata pad_size {pad} must lie in 0 .. batch_size - 1 = {size - 1}.")
    n = size - pad
    batch: dict[str, Any] = {}
    for key, entry in dict(state["batch_dict"]).items():
        if not isinstance(key, str):
            raise SkyRLDumpError(
                f"{path}: batch_dict keys must be str, got the key {_short(key)} ({type(key).__name__})."
            )
        dec = _decode_entry(key, entry, path, budget)
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
    _check_shapes(batch, path)
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


# Keys whose tensors are [N, S] or [N, R] when present; SkyRL's loss and this reader index them so.
_SEQUENCE_KEYS = ("sequences", "attention_mask")
_RESPONSE_KEYS = (
    "response_mask",
    "loss_mask",
    "advantages",
    "returns",
    "action_log_probs",
    "base_action_log_probs",
    "rollout_logprobs",
    "values",
)


def _check_shapes(batch: dict[str, Any], path: str) -> None:
    """The shapes, dtypes and values every later reading relies on; a bad one names its key."""
    seq = batch["sequences"]
    if seq.dim() != 2 or seq.shape[1] < 1:
        raise SkyRLDumpError(f"{path}: `sequences` must be [rows, S] with S >= 1, got shape {list(seq.shape)}.")
    if seq.dtype.is_floating_point or seq.dtype == torch.bool:
        raise SkyRLDumpError(
            f"{path}: `sequences` must hold integer token ids, got {str(seq.dtype).replace('torch.', '')}."
        )
    N, S = seq.shape
    if N and int(seq.min()) < 0:
        raise SkyRLDumpError(f"{path}: `sequences` holds a negative token id ({int(seq.min())}).")
    R = batch["response_mask"].shape[1] if batch["response_mask"].dim() == 2 else -1
    for key in _SEQUENCE_KEYS + _RESPONSE_KEYS:
        t = batch.get(key)
        if not isinstance(t, torch.Tensor):
            continue
        want = [N, S] if key in _SEQUENCE_KEYS else [N, R]
        if list(t.shape) != want or (key not in _SEQUENCE_KEYS and not 1 <= R <= S):
            raise SkyRLDumpError(
                f"{path}: `{key}` must have shape {'[rows, S]' if key in _SEQUENCE_KEYS else '[rows, R] with 1 <= R <= S'} = "
                f"{want if R >= 1 else '[rows, R]'}, got {list(t.shape)} (sequences is {[N, S]}; rows counted after the padding rows are dropped)."
            )
    for key in ("advantages", "loss_mask"):
        t = batch[key]
        if t.dtype.is_floating_point:
            bad = ~torch.isfinite(t.float() if t.dtype == torch.bfloat16 else t)
            if bool(bad.any()):
                r, c = (int(x) for x in bad.nonzero()[0])
                raise SkyRLDumpError(
                    f"{path}: `{key}` holds {int(bad.sum())} non-finite values (first at row {r}, column {c}: "
                    f"{float(t[r, c])}); a step trained on them cannot be read."
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


def _check_boundaries(bounds: Any, n: int, path: str) -> None:
    # Checked before any range is built: [(0, 3e8)] would otherwise materialise 3e8 row indices.
    ok = isinstance(bounds, (list, tuple)) and len(bounds) <= n
    prev = 0
    if ok:
        for b in bounds:
            if not (
                isinstance(b, (list, tuple))
                and len(b) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in b)
                and b[0] == prev
                and prev < b[1] <= n
            ):
                ok = False
                break
            prev = b[1]
    if not ok or prev != n:
        raise SkyRLDumpError(
            f"{path}: metadata `policy_prompt_boundaries` {_short(bounds)} must be (start, end) int pairs that cover "
            f"rows 0 .. {n - 1} in order, once each."
        )


def _groups(
    batch: dict[str, Any], metadata: dict[str, Any], layout: str, n: int, path: str
) -> tuple[list[list[int]], str]:
    bounds = metadata.get("policy_prompt_boundaries")
    if bounds:
        _check_boundaries(bounds, n, path)
        groups = [list(range(int(a), int(b))) for a, b in bounds]
        covered = [r for g in groups for r in g]
        if covered != list(range(n)):
            raise SkyRLDumpError(
                f"{path}: metadata `policy_prompt_boundaries` must cover rows 0 .. {n - 1} in order, once each."
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
