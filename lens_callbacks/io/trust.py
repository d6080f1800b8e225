"""The trust boundary of a run record: what its ``module`` and ``batch_builder`` may name, checked first.

A run record names code: the class the audit rebuilds (``module``) and, optionally, the function that
rebuilds a step's batch (``batch_builder``). Records travel between people, and importing a module runs its
top-level code, so nothing a record names is imported unless :class:`TrustPolicy` allows the name, and
nothing imported is called unless it is what the record says it is:

- by default, only modules of this package (``lens_callbacks.*``, its examples included) are imported; their
  location is checked before the import (a ``lens_callbacks`` elsewhere on ``sys.path``, e.g. in the working
  directory, is not trusted by name alone);
- ``allow_modules`` adds module prefixes one trusts (``--allow-module mypkg`` on the command line);
  ``trust_all`` (``--trust-record``) imports whatever the record names;
- the imported ``module`` must be a class that subclasses ``torch.nn.Module`` (a LightningModule does) and
  implements ``credit_terms``; the ``batch_builder`` a Python function that accepts
  ``(module, trajectories, meta)``; the init args must fit the class's signature and annotated types,
  every parameter present (a missing one is an error, never a default).

Pure python/torch: no lightning here.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from .safe import short_repr

__all__ = ["TrustPolicy", "DEFAULT_TRUSTED", "resolve_module_class", "resolve_batch_builder", "check_init_args"]

#: Top-level packages a record may name without ``--trust-record``; checked to lie in this distribution.
DEFAULT_TRUSTED = ("lens_callbacks",)

_MAX_PATH = 512
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")


def _short(v: Any, limit: int = 120) -> str:
    return short_repr(v, limit)


def _distribution_root() -> Path:
    import lens_callbacks

    return Path(lens_callbacks.__file__).resolve().parent.parent


@dataclass(frozen=True)
class TrustPolicy:
    """Which import paths a record may name.

    Attributes:
        allow_modules: extra module prefixes to import (``"mypkg"`` allows ``mypkg.models.Policy``).
        trust_all: import whatever the record names (the record is trusted like one's own code).
    """

    allow_modules: tuple[str, ...] = ()
    trust_all: bool = False

    def __post_init__(self) -> None:
        mods = tuple(self.allow_modules)
        for m in mods:
            if not isinstance(m, str) or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$", m):
                raise ValueError(f"`allow_modules` must hold dotted module names such as 'mypkg.models', got {m!r}.")
        object.__setattr__(self, "allow_modules", mods)
        if not isinstance(self.trust_all, bool):
            raise ValueError(f"`trust_all` must be True or False, got {self.trust_all!r}.")

    def check(self, path: Any, field: str, where: str) -> str:
        """Raise ``ValueError`` unless the record's ``field`` names an import path this policy trusts."""
        if isinstance(path, str) and len(path) > _MAX_PATH:  # before the regex: an 8 MB string costs it half a gigabyte
            raise ValueError(
                f"{where}: field `{field}` must be an import path 'package.module.Name' of at most {_MAX_PATH} "
                f"characters, got a string of {len(path):,}."
            )
        if not isinstance(path, str) or not _DOTTED.match(path):
            raise ValueError(
                f"{where}: field `{field}` must be an import path 'package.module.Name', got {_short(path)}."
            )
        if self.trust_all or any(path == p or path.startswith(p + ".") for p in self.allow_modules):
            return path
        top = path.split(".", 1)[0]
        if top in DEFAULT_TRUSTED:
            where_found = _package_location(top)
            expected = _distribution_root() / top
            if where_found is not None and _inside(where_found, expected):
                return path
            raise ValueError(
                f"{where}: field `{field}` names {path!r}, but the package {top!r} on the import path is "
                f"{where_found or 'missing'}, not the one shipped with lens_callbacks ({expected}); nothing was imported. "
                f"Pass --trust-record (or --allow-module {top}) if you trust it."
            )
        raise ValueError(
            f"{where}: field `{field}` names {path!r}, outside the modules a record may name by default "
            f"({', '.join(DEFAULT_TRUSTED)}); nothing was imported. Importing a module runs its code: pass "
            f"--allow-module {top} (or --trust-record) only if you trust the record."
        )


def _package_location(top: str) -> "Path | None":
    mod = sys.modules.get(top)
    if mod is not None:
        f = getattr(mod, "__file__", None)
        return Path(f).resolve().parent if f else None
    try:
        spec = importlib.util.find_spec(top)  # finds a top-level package without running its code
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
        return None
    return Path(spec.origin).resolve().parent


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def _cwd_on_path() -> None:
    # Class paths resolve from the working directory, as for `fit`. This happens before the trust check,
    # so the package the check locates is the one the import will load.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def _import(path: str, field: str, where: str) -> Any:
    mod, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"{where}: field `{field}` names {path!r}, which could not be imported ({err}); run from the directory it was trained in."
        ) from None


def resolve_module_class(path: Any, policy: TrustPolicy, where: str) -> type:
    """The class a record's ``module`` names: trusted, a ``torch.nn.Module`` subclass with ``credit_terms``."""
    _cwd_on_path()
    policy.check(path, "module", where)
    obj = _import(path, "module", where)
    if not (isinstance(obj, type) and issubclass(obj, torch.nn.Module)):
        raise ValueError(
            f"{where}: field `module` must name a LightningModule (or torch.nn.Module) class, got {path!r}, "
            f"a {type(obj).__name__}; it was not called."
        )
    if not callable(getattr(obj, "credit_terms", None)):
        raise ValueError(
            f"{where}: field `module` names {path!r}, which does not implement `credit_terms(batch)`; "
            "only a module that does can be audited."
        )
    return obj


def resolve_batch_builder(path: Any, policy: TrustPolicy, where: str) -> Callable[..., Any]:
    """The function a record's ``batch_builder`` names: trusted, a Python function of ``(module, trajectories, meta)``."""
    _cwd_on_path()
    policy.check(path, "batch_builder", where)
    fn = _import(path, "batch_builder", where)
    if not inspect.isfunction(fn):
        raise ValueError(
            f"{where}: field `batch_builder` must name a Python function fn(module, trajectories, meta) -> batch, "
            f"got {path!r}, a {type(fn).__name__}; it was not called."
        )
    try:
        inspect.signature(fn).bind(None, [], {})
    except TypeError as err:
        raise ValueError(
            f"{where}: field `batch_builder` names {path!r}, whose signature {inspect.signature(fn)} does not take "
            f"(module, trajectories, meta) ({err}); it was not called."
        ) from None
    return fn


def _type_name(t: Any) -> str:
    return getattr(t, "__name__", None) or str(t).replace("typing.", "")


def _fits(value: Any, t: Any) -> bool:
    """Whether a JSON value fits a simple annotation; annotations this cannot judge are accepted."""
    if t is Any or t is inspect.Parameter.empty:
        return True
    origin = typing.get_origin(t)
    if origin is typing.Union or (origin is not None and type(t).__name__ == "UnionType"):
        return any(_fits(value, a) for a in typing.get_args(t))
    if t is type(None):
        return value is None
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in typing.get_args(t))
    if t is bool:
        return isinstance(value, bool)
    if t is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if t is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if t is str:
        return isinstance(value, str)
    if t in (list, tuple, Sequence) or origin in (list, tuple, Sequence, typing.Sequence):
        return isinstance(value, (list, tuple))
    if t in (dict, Mapping) or origin in (dict, Mapping, typing.Mapping):
        return isinstance(value, dict)
    return True


def check_init_args(cls: type, args: Any, where: str) -> dict[str, Any]:
    """The init args to rebuild ``cls`` with, checked against its signature before anything is built.

    Keys starting with ``_`` (bookkeeping LightningCLI adds to hparams, e.g. ``_class_path``) are dropped. Every
    other key must be a parameter (unless ``__init__`` takes ``**kwargs``), every parameter must be present
    (the record must say how the module was built: a default could build another one), and each value must
    fit the parameter's annotation (or its default's type when unannotated); floats must be finite.
    """
    if not isinstance(args, dict):
        raise ValueError(
            f"{where}: field `init_args` must be a JSON object of the module's init arguments, got {type(args).__name__}."
        )
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: the signature of {cls.__qualname__}.__init__ cannot be read ({err}).") from None
    params = [p for p in list(sig.parameters.values())[1:]]
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    named = {
        p.name: p for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    out = {k: v for k, v in args.items() if not (isinstance(k, str) and k.startswith("_"))}
    unknown = [k for k in out if k not in named]
    if unknown and not var_kw:
        shown = ", ".join(_short(k, 40) for k in sorted(unknown[:1000])[:5]) + (
            f" and {len(unknown) - 5:,} more" if len(unknown) > 5 else ""
        )
        raise ValueError(
            f"{where}: field `init_args` holds {shown}, which {cls.__qualname__}.__init__ does not take "
            f"(it takes {sorted(named)})."
        )
    missing = [n for n in named if n not in out]
    if missing:
        raise ValueError(
            f"{where}: field `init_args` is missing {missing[:8]}: the record must hold every argument "
            f"{cls.__qualname__} was built with (a default could rebuild a different module)."
        )
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # unresolvable forward references: fall back to the defaults' types
        hints = {}
    for name, p in named.items():
        t = hints.get(name, inspect.Parameter.empty)
        if t is inspect.Parameter.empty and p.default is not inspect.Parameter.empty and p.default is not None:
            t = type(p.default) if type(p.default) in (bool, int, float, str) else inspect.Parameter.empty
            if t is float:
                t = typing.Union[int, float]
        value = out[name]
        if not _fits(value, t):
            raise ValueError(
                f"{where}: field `init_args.{name}` must be {_type_name(t)}"
                f"{' (finite)' if 'float' in _type_name(t) else ''}, got {_short(value)}."
            )
    return out
