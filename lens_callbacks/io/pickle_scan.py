"""A static pass over a pickle's opcodes that bounds what unpickling it can cost, before anything is built.

The pass runs nothing: it follows the pickle machine's stack and memo with stand-in records of what each
opcode would push (``pickletools.genops`` decodes the arguments) and refuses, naming the file and the field
(the dict keys on the way to the offending value), a stream

- whose structure, fully expanded, is too large: every memo read counts the whole object it refers to, so a
  DAG (``t_k = [t_{k-1}, t_{k-1}]``, 50 levels in 1 KB) counts as the tree of 2**50 nodes a walk or a copy
  of it visits, and one 1 MiB byte string referenced 600 times counts as 600 MiB. Nodes are capped at
  ``max_nodes``, bytes at the read budget; a structure that contains itself is refused;
- that hashes an attacker's structure: a dict key or set member (also the keys a dict-like constructor or a
  ``BUILD`` hashes from a list of pairs) that is a tuple or an object nesting more than
  :data:`MAX_KEY_DEPTH` levels or holding more than :data:`MAX_KEY_NODES` nodes once expanded (a 64-level
  tuple DAG costs 2**64 to hash), or more than :data:`MAX_CONTAINER_KEYS` such keys in one stream (tuple
  hashes are not randomized, so many of them can be chosen to collide);
- that holds an integer wider than 64 bits: such keys are the only ints whose hashes can collide in bulk
  (``hash(k * (2**61 - 1)) == 0`` for every k), and no SkyRL dump or checkpoint holds one;
- with more than ``max_opcodes`` opcodes, memo indices beyond the entries stored, memo reads of entries
  never stored, declared lengths or frames beyond the bytes that remain, or no ``STOP``.

Every check costs time linear in the stream: each opcode is decoded once and the expansion is computed once
per distinct object (memoized), so doubling an attacker's parameter at most doubles the cost of a refusal. A
container's expansion so far is also kept as it fills (a lower bound of the final one, since containers only
grow), so a stream is refused as soon as one passes a limit.
"""

from __future__ import annotations

import gc
import io
import pickletools
import re
from typing import Optional

__all__ = [
    "PickleRefused",
    "scan_pickle_stream",
    "MAX_KEY_DEPTH",
    "MAX_KEY_NODES",
    "MAX_CONTAINER_KEYS",
    "MAX_INT_BITS",
]

#: How deeply a dict key or set member may nest tuples (``((1, 2), 3)`` nests 2 deep).
MAX_KEY_DEPTH = 3
#: How many nodes a dict key or set member may hold once expanded (its hash visits every one).
MAX_KEY_NODES = 256
#: How many tuple (or object) keys and set members one stream may hold: tuple hashes can be chosen to collide.
MAX_CONTAINER_KEYS = 1_000
#: Integers must fit in 64 bits (signed or unsigned).
MAX_INT_BITS = 64

# Counts saturate here: a DAG of a million levels would otherwise make its counts million-bit integers.
_SAT = 1 << 62

# Atoms larger than this are kept as their own node, so that an expansion refusal can say where they are.
_FOLD_BYTES = 1 << 16

# Constructors whose arguments are hashed: sets hash their members, dict-likes the first item of each pair.
_HASHING_CONSTRUCTORS = {
    "builtins.set": "members",
    "builtins.frozenset": "members",
    "collections.Counter": "members",
    "builtins.dict": "pairs",
    "collections.OrderedDict": "pairs",
    "collections.defaultdict": "pairs",
    "skyrl.backends.skyrl_train.training_batch.TrainingInputBatch": "pairs",
    "skyrl_train.training_batch.TrainingInputBatch": "pairs",
}

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.:/\-]{1,64}$")
#: A special attribute's name (``__del__``, ``__class__``): never a field of the state a dump or checkpoint holds.
_DUNDER = re.compile(r"^__\w+__$")

# Item kinds.
_ATOM, _GLOBAL, _TUPLE, _FSET, _OBJ, _LIST, _DICT, _SET, _MARK = range(9)
_HASHABLE = (_ATOM, _GLOBAL, _TUPLE, _FSET, _OBJ)
_DICTLIKE = (_DICT, _OBJ)


class PickleRefused(ValueError):
    """A pickle refused by the static pass; the message names the file and, where known, the field."""


class _Item:
    """What one stack slot or memo entry would hold: own weight, kept children, and (for keys) nesting."""

    __slots__ = (
        "kind",
        "w",
        "b",
        "kids",
        "labels",
        "depth",
        "hnodes",
        "name",
        "first",
        "xn",
        "xb",
        "state",
        "en",
        "eb",
        "dunder",
    )

    def __init__(self, kind: int, b: int = 0, name: Optional[str] = None) -> None:
        self.kind = kind
        self.w = 1  # nodes counted in this item itself (folded small atoms included)
        self.b = b  # payload bytes counted in this item itself
        self.kids: Optional[list] = None  # children kept as items (containers, large atoms)
        self.labels: Optional[list] = None  # dicts: the key name of each kept child (or None)
        self.depth = 0 if kind in (_ATOM, _GLOBAL) else 1  # nesting of containers (atoms 0, a flat tuple 1)
        self.hnodes = 1  # nodes a hash of it visits (hashable kinds)
        self.name = name  # a str atom's value when it is a safe field name; a global's dotted name
        self.first: Optional["_Item"] = None  # tuples: the first element when it is not an atom
        self.xn = self.xb = self.state = 0  # the expansion's nodes and bytes; 0 unseen, 1 on the DFS path, 2 done
        # The expansion so far, summed as children are added: a lower bound of the final one (containers only
        # grow), so a stream is refused as soon as it passes a limit, not after the rest is read.
        self.en, self.eb = 1, b
        self.dunder: Optional[str] = None  # dicts: a key of theirs that names a special attribute (``__del__``)


_MARK_ITEM = _Item(_MARK)

# Opcode groups, most frequent first in the pass's dispatch.
(
    _G_GET,
    _G_PUT,
    _G_MEMOIZE,
    _G_STR,
    _G_INT,
    _G_ATOM,
    _G_MARK,
    _G_SETITEMS,
    _G_SETITEM,
    _G_APPENDS,
    _G_APPEND,
    _G_TUPLEN,
    _G_TUPLE,
    _G_EMPTY,
    _G_STOP,
    _G_FRAME,
) = range(16)
_GROUPS = {
    **dict.fromkeys(("GET", "BINGET", "LONG_BINGET"), _G_GET),
    **dict.fromkeys(("PUT", "BINPUT", "LONG_BINPUT"), _G_PUT),
    "MEMOIZE": _G_MEMOIZE,
    **dict.fromkeys(
        (
            "STRING",
            "BINSTRING",
            "SHORT_BINSTRING",
            "BINBYTES",
            "SHORT_BINBYTES",
            "BINBYTES8",
            "BYTEARRAY8",
            "UNICODE",
            "SHORT_BINUNICODE",
            "BINUNICODE",
            "BINUNICODE8",
        ),
        _G_STR,
    ),
    **dict.fromkeys(("INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4"), _G_INT),
    **dict.fromkeys(("NONE", "NEWTRUE", "NEWFALSE", "FLOAT", "BINFLOAT", "NEXT_BUFFER"), _G_ATOM),
    "MARK": _G_MARK,
    "SETITEMS": _G_SETITEMS,
    "SETITEM": _G_SETITEM,
    "APPENDS": _G_APPENDS,
    "APPEND": _G_APPEND,
    **dict.fromkeys(("TUPLE1", "TUPLE2", "TUPLE3"), _G_TUPLEN),
    "TUPLE": _G_TUPLE,
    **dict.fromkeys(("EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"), _G_EMPTY),
    "STOP": _G_STOP,
    **dict.fromkeys(("PROTO", "FRAME"), _G_FRAME),
}


def _add(parent: _Item, child: _Item, label: Optional[str] = None) -> None:
    en, eb = parent.en + child.en, parent.eb + child.eb
    parent.en = en if en < _SAT else _SAT
    parent.eb = eb if eb < _SAT else _SAT
    if child.kind == _ATOM and child.b < _FOLD_BYTES:
        parent.w += 1
        parent.b += child.b
    else:
        if parent.kids is None:
            parent.kids = []
        parent.kids.append(child)
        if label is not None or parent.labels is not None:
            if parent.labels is None:
                parent.labels = [None] * (len(parent.kids) - 1)
            parent.labels.append(label)
    if child.kind != _ATOM and child.kind != _GLOBAL and child.depth + 1 > parent.depth:
        parent.depth = child.depth + 1


def _hashable_container(kind: int, kids: list) -> _Item:
    """A tuple/frozenset/object built from ``kids``: its hash visits every hashable node below it."""
    it = _Item(kind)
    h = 1
    for k in kids:
        _add(it, k)
        h += k.hnodes if k.kind in _HASHABLE else 1
    it.hnodes = h if h < _SAT else _SAT
    if kind == _TUPLE and kids and kids[0].kind != _ATOM:
        it.first = kids[0]
    return it


class _Scan:
    def __init__(
        self, path: str, what: str, max_opcodes: int, max_nodes: int, max_bytes: int, budget_note: str
    ) -> None:
        self.path, self.what = path, what
        self.max_opcodes, self.max_nodes, self.max_bytes, self.budget_note = (
            max_opcodes,
            max_nodes,
            max_bytes,
            budget_note,
        )
        self.stack: list = []
        self.memo: dict = {}
        self.container_keys = 0

    # ------------------------------------------------------------------------------------------ messages
    def field(self) -> str:
        """The dict keys leading to the value being built now, from the stack (e.g. ``metadata.uids``)."""
        st, names = self.stack, []
        n = len(st)
        i = 0
        while i < n:
            it = st[i]
            if it is _MARK_ITEM and i >= 1 and st[i - 1].kind in _DICTLIKE:
                j, last = i + 1, None
                while j < n and st[j] is not _MARK_ITEM:
                    if (j - i - 1) % 2 == 0:
                        last = st[j]
                    j += 1
                if (j - i - 1) % 2:  # a key waiting for the value being built
                    names.append(_label(last))
                elif j - i - 1 >= 2 and (j == n or st[j - 1].kind in (_LIST, _DICT, _SET, _OBJ)):
                    # The last value: on top (being filled now), or a container that the MARK after it fills. (A key
                    # built right after a container value reads the same way; the message then names that value.)
                    names.append(_label(st[j - 2]))
                elif j < n:  # complete pairs, then a MARK for something new: a key under construction
                    names.append("<a key>")
                i = j
                continue
            if it.kind in _DICTLIKE and i + 1 < n and st[i + 1] is not _MARK_ITEM and st[i + 1].kind == _ATOM:
                names.append(_label(st[i + 1]))
                i += 2
                continue
            i += 1
        return ".".join(names) if names else "(top level)"

    def refuse(self, why: str, field: Optional[str] = None) -> None:
        raise PickleRefused(f"{self.path}: `{field if field is not None else self.field()}`: the {self.what} {why}")

    def key_field(self, in_dict: bool) -> Optional[str]:
        if not in_dict:
            return None
        f = self.field()
        return "a key of " + f if f != "(top level)" else "a key at the top level"

    # ------------------------------------------------------------------------------------------ stack
    def grew(self, it: _Item, field: Optional[str] = None) -> None:
        """Refuse as soon as an item's expansion so far passes a limit (it can only grow)."""
        if it.en > self.max_nodes:
            self.refuse(
                f"expands to more than {self.max_nodes:,} nodes once its shared references are counted at their "
                "full size; a walk or copy of it would never end.",
                field,
            )
        if it.eb > self.max_bytes:
            self.refuse(
                f"expands to more than {self.max_bytes / (1 << 20):,.1f} MiB once its shared references are counted "
                f"at their full size, beyond the read budget{self.budget_note}.",
                field,
            )

    def pop_mark(self) -> list:
        st = self.stack
        for i in range(len(st) - 1, -1, -1):
            if st[i] is _MARK_ITEM:
                items = st[i + 1 :]
                del st[i:]
                return items
        raise PickleRefused(
            f"{self.path}: the {self.what} is corrupt (an opcode pops to a MARK that was never pushed)."
        )

    def pop(self, n: int = 1) -> list:
        st = self.stack
        if len(st) < n or any(x is _MARK_ITEM for x in st[len(st) - n :]):
            raise PickleRefused(f"{self.path}: the {self.what} is corrupt (an opcode pops more than the stack holds).")
        items = st[len(st) - n :]
        del st[len(st) - n :]
        return items

    def top(self) -> _Item:
        if not self.stack or self.stack[-1] is _MARK_ITEM:
            raise PickleRefused(f"{self.path}: the {self.what} is corrupt (an opcode needs a value on an empty stack).")
        return self.stack[-1]

    # ------------------------------------------------------------------------------------------ keys
    def check_key(self, key: _Item, in_dict: bool = False) -> None:
        if key.kind == _ATOM or key.kind == _GLOBAL:
            return
        if key.kind not in _HASHABLE:
            return  # a list or dict as a key fails at once in the unpickler (unhashable), before any work
        self.container_keys += 1
        if key.depth > MAX_KEY_DEPTH:
            self.refuse(
                f"uses a key nesting containers {key.depth} deep (at most {MAX_KEY_DEPTH}); hashing such a key can "
                "cost as much as its fully expanded tree.",
                self.key_field(in_dict),
            )
        if key.hnodes > MAX_KEY_NODES:
            self.refuse(
                f"uses a key of {key.hnodes:,} nodes once expanded (at most {MAX_KEY_NODES}); hashing it visits "
                "every one.",
                self.key_field(in_dict),
            )
        if self.container_keys > MAX_CONTAINER_KEYS:
            self.refuse(
                f"uses more than {MAX_CONTAINER_KEYS:,} tuple keys or set members; their hashes are not randomized "
                "and can be chosen to collide.",
                self.key_field(in_dict),
            )

    def check_hashed_args(self, callable_item: _Item, args: _Item) -> None:
        """A constructor that hashes what it is given: check the members or pair keys of its first argument."""
        mode = _HASHING_CONSTRUCTORS.get(callable_item.name or "") if callable_item.kind == _GLOBAL else None
        if mode is None or not args.kids:
            return
        first = args.kids[0] if args.kind == _TUPLE and args.first is not None else None
        if first is not None:
            self.check_elements(first, mode)

    def check_elements(self, seq: _Item, mode: str) -> None:
        for k in seq.kids or ():
            if mode == "members":
                self.check_key(k)
            elif k.kind == _TUPLE and k.first is not None:
                self.check_key(k.first)

    # ------------------------------------------------------------------------------------------ the pass
    def run(self, data: bytes) -> int:
        gc_was = gc.isenabled()
        gc.disable()  # the pass allocates one small record per opcode; collections would make it superlinear
        try:
            return self._run(data)
        finally:
            if gc_was:
                gc.enable()

    def _run(self, data: bytes) -> int:
        n = 0
        memo, stack = self.memo, self.stack
        push = stack.append
        size = len(data)
        stopped = False
        root: Optional[_Item] = None
        max_ops = self.max_opcodes
        groups = _GROUPS
        try:
            for op, arg, pos in pickletools.genops(io.BytesIO(data)):
                n += 1
                if n > max_ops:
                    raise PickleRefused(
                        f"{self.path}: the {self.what} holds more than {max_ops:,} opcodes; refused as "
                        "a time bomb (a SkyRL dump or checkpoint holds a few thousand)."
                    )
                g = groups.get(op.name, -1)
                if g == _G_GET:
                    item = memo.get(int(arg))
                    if item is None:
                        raise PickleRefused(
                            f"{self.path}: the {self.what} reads memo index {int(arg)} at byte {pos}, which "
                            "was never stored."
                        )
                    push(item)
                elif g == _G_PUT:
                    idx = int(arg)
                    if idx < 0 or idx > len(memo):
                        raise PickleRefused(
                            f"{self.path}: the {self.what} stores memo index {idx} at byte {pos} while only "
                            f"{len(memo)} entries exist; refused (a memo table that large costs memory the "
                            "file does not hold)."
                        )
                    memo[idx] = self.top()
                elif g == _G_MEMOIZE:
                    memo[len(memo)] = self.top()
                elif g == _G_STR:
                    if isinstance(arg, str):
                        push(_Item(_ATOM, len(arg), arg if len(arg) <= 64 and _SAFE_NAME.match(arg) else None))
                    else:
                        push(_Item(_ATOM, len(arg) if isinstance(arg, (bytes, bytearray)) else 0))
                elif g == _G_INT:
                    if type(arg) is int and not -(1 << 63) <= arg < (1 << MAX_INT_BITS):
                        self.refuse(
                            f"holds an integer of {arg.bit_length():,} bits at byte {pos}; numbers wider than "
                            f"{MAX_INT_BITS} bits are refused (no dump or checkpoint holds one, and such keys can be "
                            "chosen so that all hash alike)."
                        )
                    push(_Item(_ATOM))
                elif g == _G_ATOM:
                    push(_Item(_ATOM))
                elif g == _G_MARK:
                    push(_MARK_ITEM)
                elif g == _G_SETITEMS:
                    items = self.pop_mark()
                    self._setitems(self.top(), items)
                elif g == _G_SETITEM:
                    k, v = self.pop(2)
                    self._setitems(self.top(), [k, v])
                elif g == _G_APPENDS:
                    items = self.pop_mark()
                    target = self.top()
                    for v in items:
                        _add(target, v)
                    self.grew(target)
                elif g == _G_APPEND:
                    (v,) = self.pop(1)
                    _add(self.top(), v)
                    self.grew(self.top())
                elif g == _G_TUPLEN:
                    push(_hashable_container(_TUPLE, self.pop(int(op.name[-1]))))
                    self.grew(stack[-1])
                elif g == _G_TUPLE:
                    push(_hashable_container(_TUPLE, self.pop_mark()))
                    self.grew(stack[-1])
                elif g == _G_EMPTY:
                    name = op.name
                    if name == "EMPTY_TUPLE":
                        push(_hashable_container(_TUPLE, []))
                    else:
                        push(_Item(_LIST if name == "EMPTY_LIST" else _DICT if name == "EMPTY_DICT" else _SET))
                elif g == _G_STOP:
                    root = self.top() if stack else None
                    stopped = True
                    break
                elif g == _G_FRAME:
                    if op.name == "FRAME" and int(arg) > size - pos:
                        raise PickleRefused(
                            f"{self.path}: the {self.what} is truncated or corrupt: it declares a frame of "
                            f"{int(arg):,} bytes at byte {pos}; only {size - pos:,} remain."
                        )
                else:
                    self._rare(op.name, arg, pos)
                    if stack and stack[-1] is not _MARK_ITEM:
                        self.grew(stack[-1])
        except PickleRefused:
            raise
        except ValueError as err:  # a declared length beyond the data, an unknown opcode, a bad line
            text = " ".join(str(err).split())
            raise PickleRefused(f"{self.path}: the {self.what} is corrupt or truncated ({text[:200]}).") from None
        if not stopped:
            raise PickleRefused(f"{self.path}: the {self.what} is truncated (it ends without STOP).")
        if root is not None:
            self.check_expansion(root)
        return n

    def _rare(self, name: str, arg, pos: int) -> None:
        stack = self.stack
        push = stack.append
        if name == "READONLY_BUFFER":
            self.top()
        elif name == "FROZENSET":
            items = self.pop_mark()
            for k in items:
                self.check_key(k)
            push(_hashable_container(_FSET, items))
        elif name == "LIST":
            lst = _Item(_LIST)
            for k in self.pop_mark():
                _add(lst, k)
            push(lst)
        elif name == "DICT":
            items = self.pop_mark()
            d = _Item(_DICT)
            push(d)
            self._setitems(d, items)
        elif name == "ADDITEMS":
            items = self.pop_mark()
            target = self.top()
            for k in items:
                self.check_key(k)
                _add(target, k)
        elif name == "POP":
            if stack and stack[-1] is _MARK_ITEM:
                stack.pop()  # pickle's POP also discards a MARK
            else:
                self.pop(1)
        elif name == "POP_MARK":
            self.pop_mark()
        elif name == "DUP":
            push(self.top())
        elif name == "GLOBAL":
            push(_Item(_GLOBAL, name=str(arg).replace(" ", ".")))
        elif name == "STACK_GLOBAL":
            mod, nm = self.pop(2)
            push(_Item(_GLOBAL, name=f"{mod.name}.{nm.name}" if mod.name and nm.name else None))
        elif name in ("EXT1", "EXT2", "EXT4"):
            push(_Item(_GLOBAL))
        elif name == "REDUCE":
            fn, args = self.pop(2)
            self.check_hashed_args(fn, args)
            push(_hashable_container(_OBJ, [fn, args]))
        elif name == "NEWOBJ":
            push(_hashable_container(_OBJ, self.pop(2)))
        elif name == "NEWOBJ_EX":
            push(_hashable_container(_OBJ, self.pop(3)))
        elif name in ("INST", "OBJ"):
            items = self.pop_mark()
            if name == "INST":
                items = [_Item(_GLOBAL, name=str(arg).replace(" ", "."))] + items
            if items:
                self.check_hashed_args(items[0], _hashable_container(_TUPLE, items[1:]))
            push(_hashable_container(_OBJ, items))
        elif name == "BUILD":
            (state,) = self.pop(1)
            obj = self.top()
            if obj.kind == _GLOBAL:
                # BUILD on what find_class handed out sets attributes of a class or function the reader itself
                # runs (a `__del__` that builds another instance when one is freed never stops).
                self.refuse(
                    f"applies BUILD (attribute state) to the global {obj.name or '(unnamed)'} at byte {pos}: that "
                    "would set attributes of a class the reader runs; no SkyRL dump or checkpoint does so."
                )
            for part in [state] + (list(state.kids or []) if state.kind == _TUPLE else []):
                if part.dunder is not None:
                    self.refuse(
                        f"sets the special attribute {part.dunder} through BUILD at byte {pos}: state that names "
                        "__del__, __class__, __reduce__, __setstate__ or the like is refused (it changes how an "
                        "object behaves, not what it holds)."
                    )
            # A dict-like's __dict__.update(state) hashes the first item of each pair of a list state.
            s = state.first if state.kind == _TUPLE and state.first is not None else state
            if s.kind == _LIST:
                self.check_elements(s, "pairs")
            _add(obj, state)
        elif name == "PERSID":
            push(_Item(_OBJ))
        elif name == "BINPERSID":
            (pid,) = self.pop(1)
            push(_hashable_container(_OBJ, [pid]))
        else:  # an opcode this pass does not model: refuse rather than guess its effect
            raise PickleRefused(
                f"{self.path}: the {self.what} uses the opcode {name} at byte {pos}, which no SkyRL dump or "
                "checkpoint holds."
            )

    def _setitems(self, d: _Item, items: list) -> None:
        if len(items) % 2:
            raise PickleRefused(f"{self.path}: the {self.what} is corrupt (SETITEMS with an odd number of items).")
        for i in range(0, len(items), 2):
            k, v = items[i], items[i + 1]
            self.check_key(k, in_dict=True)
            if k.kind == _ATOM and k.name is not None and _DUNDER.match(k.name):
                d.dunder = k.name
            _add(d, k)
            _add(d, v, k.name if k.kind == _ATOM else None)
            if d.en > self.max_nodes or d.eb > self.max_bytes:  # name the entry that passed the limit
                f = self.field()
                self.grew(d, _label(k) if f == "(top level)" else f"{f}.{_label(k)}")

    # ------------------------------------------------------------------------------------------ expansion
    def check_expansion(self, root: _Item) -> None:
        """Nodes and bytes of the fully expanded tree under ``root``, each distinct item computed once."""
        cycle = "holds a structure that contains itself; its expansion never ends."
        root.state = 1
        todo = [root]
        while todo:
            it = todo[-1]
            kids = it.kids
            if it.state == 2:  # pushed twice (shared), already summed
                todo.pop()
                continue
            if it.state == 1 and kids:
                it.state = 3  # on the path: its children are above it; sum them when it is on top again
                for k in kids:
                    st = k.state
                    if st == 3:  # an ancestor of itself
                        self.refuse(cycle, "(a cycle)")
                    if st != 2:
                        k.state = 1
                        todo.append(k)
                continue
            todo.pop()
            nodes, nbytes = it.w, it.b
            for k in kids or ():
                nodes += k.xn
                nbytes += k.xb
            it.xn = nodes if nodes < _SAT else _SAT
            it.xb = nbytes if nbytes < _SAT else _SAT
            it.state = 2
        nodes, nbytes = root.xn, root.xb
        if nodes > self.max_nodes:
            self.refuse(
                f"expands to {'more than ' + format(_SAT, ',') if nodes >= _SAT else format(nodes, ',')} nodes once its "
                f"shared references are counted at their full size, more than {self.max_nodes:,}; a walk or copy of it "
                "would never end.",
                self._where(root, 0, self.max_nodes),
            )
        if nbytes > self.max_bytes:
            self.refuse(
                f"expands to {nbytes / (1 << 20):,.1f} MiB once its shared references are counted at their full "
                f"size, beyond the read budget of {self.max_bytes / (1 << 20):,.1f} MiB{self.budget_note}.",
                self._where(root, 1, self.max_bytes),
            )

    def _where(self, root: _Item, which: int, cap: int) -> str:
        """The dict keys down to the child at which the expansion first passes ``cap``."""
        names: list = []
        it = root
        for _ in range(10_000):
            acc = (it.w, it.b)[which]
            nxt = None
            for j, k in enumerate(it.kids or ()):
                s = (k.xn, k.xb)[which]
                acc += s
                if acc > cap:
                    label = it.labels[j] if it.labels is not None and j < len(it.labels) else None
                    if label is not None:
                        names.append(label)
                    nxt = k if s > cap else None
                    if nxt is None:
                        return ".".join(names) or "(top level)"
                    break
            if nxt is None:
                break
            it = nxt
        return ".".join(names) or "(top level)"


def _label(it: _Item) -> str:
    if it.kind == _ATOM and it.name:
        return it.name
    return "<a key>" if it.kind == _ATOM else "<a container key>"


def scan_pickle_stream(
    data: bytes, path: str, what: str, *, max_opcodes: int, max_nodes: int, max_bytes: int, budget_note: str = ""
) -> int:
    """Run the static pass over ``data``; return the number of opcodes. Raises :class:`PickleRefused`."""
    return _Scan(path, what, max_opcodes, max_nodes, max_bytes, budget_note).run(data)
