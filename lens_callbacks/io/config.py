"""A LightningCLI YAML config read as data, bounded: ``yaml.safe_load`` with a size cap and an expansion cap.

``anchor-arms --config`` reads the user's config to rewrite it once per arm. A config *is* code by design
(its ``class_path`` entries are imported and called by LightningCLI, see docs/security.md), so this reader
does not make an untrusted config safe to run; it makes reading it bounded and its errors one line:

- a regular file (no FIFO, device or ``/proc`` file) of at most :data:`MAX_CONFIG_BYTES`;
- ``yaml.SafeLoader`` (or its libyaml twin ``CSafeLoader``) only (``!!python/object/apply`` and every other non-standard tag is an error);
- the document's size with every alias expanded (as JSON or a copy would expand it) at most
  :data:`MAX_CONFIG_NODES` nodes, counted once per node before anything is constructed, and no alias
  that contains itself (an alias bomb of a few hundred bytes stops here);
- a YAML error is a ``ValueError`` naming the file, the line and the column, quoting none of the file's lines.

Pure python (PyYAML).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from .safe import BoundedReadError, PathLike, ReadLimits, open_regular_file, read_exactly

__all__ = ["read_config_yaml", "MAX_CONFIG_BYTES", "MAX_CONFIG_NODES"]

MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_NODES = 200_000


def _children(node: Any) -> list:
    import yaml

    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for kv in node.value for n in kv]
    return []


def expanded_nodes(node: Any, limit: int, path: str) -> int:
    """Nodes of the document with each alias counted at its full size; linear in the distinct nodes.

    Raises ``ValueError`` past ``limit`` or on an alias that contains itself.
    """
    memo: dict[int, int] = {}
    open_: set[int] = set()  # started, not finished: the ancestors of the node being visited
    stack: list[tuple[Any, bool]] = [(node, False)]
    while stack:
        n, done = stack.pop()
        i = id(n)
        if done:
            total = 1 + sum(memo[id(c)] for c in _children(n))
            open_.discard(i)
            if total > limit:
                raise ValueError(
                    f"{path}: the config expands to more than {limit:,} nodes once its aliases are expanded "
                    f"(line {n.start_mark.line + 1}); refused (an alias bomb)."
                )
            memo[i] = total
            continue
        if i in memo:
            continue
        open_.add(i)
        stack.append((n, True))
        for c in _children(n):
            if id(c) in open_:
                raise ValueError(
                    f"{path}: the config holds an alias that contains itself (line {c.start_mark.line + 1}); refused."
                )
            if id(c) not in memo:
                stack.append((c, False))
    return memo[id(node)]


def _yaml_error(path: str, err: Exception) -> ValueError:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or getattr(err, "context", None) or type(err).__name__
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    text = " ".join(str(problem).split())
    text = text if len(text) <= 200 else text[:197] + "..."
    return ValueError(f"{path}: the config is not YAML that safe_load reads: {text}{where}.")


def read_config_yaml(path: PathLike, limits: Optional[ReadLimits] = None) -> Any:
    """The parsed config (``None`` for an empty file), read bounded; every failure a one-line ``ValueError``."""
    import yaml

    shown = os.fspath(path)
    limits = limits or ReadLimits.from_env()
    fd, size = open_regular_file(shown, limits, "config")
    try:
        if size > MAX_CONFIG_BYTES:
            raise BoundedReadError(
                f"{shown}: the config is {size:,} bytes, more than the {MAX_CONFIG_BYTES:,} a "
                "LightningCLI config needs; refused before reading it."
            )
        data = read_exactly(fd, size, shown, "config")
    finally:
        os.close(fd)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{shown}: the config is not UTF-8 text ({err.reason} at byte {err.start}).") from None
    # libyaml's parser when PyYAML has it (the same safe constructor; composing is several times faster).
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        expanded_nodes(node, MAX_CONFIG_NODES, shown)
        doc = loader.construct_document(node)
    except yaml.YAMLError as err:
        raise _yaml_error(shown, err) from None
    except RecursionError:
        raise ValueError(f"{shown}: the config nests too deeply; refused.") from None
    except ValueError as err:  # e.g. an integer longer than Python converts (sys.get_int_max_str_digits)
        raise ValueError(f"{shown}: the config holds a value that cannot be read ({one_line_reason(err)}).") from None
    finally:
        loader.dispose()
    _check_keys(doc, shown)
    return doc


def one_line_reason(err: BaseException, limit: int = 200) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[:limit] + "…"


def _check_keys(doc: Any, path: str) -> None:
    """Every mapping key is a string (an option name): a ``null`` or number key would reach the
    commands as a key no option has, and break what sorts or prints the config."""
    seen: set[int] = set()
    stack = [doc]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or not isinstance(obj, (dict, list)):
            continue
        seen.add(id(obj))  # aliases share objects: each is walked once
        if isinstance(obj, dict):
            bad = next((k for k in obj if not isinstance(k, str)), _NO_KEY)
            if bad is not _NO_KEY:
                raise ValueError(
                    f"{path}: every key of the config must be an option name (a string), got a "
                    f"{type(bad).__name__} key; quote it or remove it."
                )
            stack.extend(obj.values())
        else:
            stack.extend(obj)


_NO_KEY = object()
