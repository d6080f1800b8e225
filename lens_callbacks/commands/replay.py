"""The offline replay of a run record, shared by ``lens-callbacks audit`` and its ``--probe`` reading.

Rebuilds the recorded module (checked against the checkpoint before it is built), re-applies the recorded
steps from the nearest usable checkpoint (:func:`replay_to`), rebuilds a step's rollout batch, and bounds
what each of these builds by the memory budget (``LENS_MEMORY_MB``) before building it. See
:mod:`lens_callbacks.commands.audit` for the command and what makes a replay exact.
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence, Union

import torch

from ..credit.inputs.partition import PARTITIONS, Partition
from ..credit.inputs.trajectories import by_role, by_turn
from ..io.budget import shown_value
from ..io.records import RunRecord, step_path
from ..io.safe import ReadLimits
from ..io.trust import TrustPolicy, check_init_args, resolve_batch_builder, resolve_module_class
from ..refusal import Refusal
from ._errors import (
    one_line,
)

__all__ = [
    "AUDIT_PARTITIONS",
    "PartCountBound",
    "check_built_positions",
    "check_part_count",
    "check_sizes_against_checkpoint",
    "check_token_ids",
    "load_module",
    "make_optimizer",
    "manifest_where",
    "rebuild_batch",
    "replay_blocker",
    "replay_to",
    "set_recorded_lrs",
    "stateless_optimizer",
]

AUDIT_PARTITIONS = {**PARTITIONS, "by_turn": by_turn, "by_role": by_role}


def _trust(record: RunRecord) -> TrustPolicy:
    return getattr(record, "trust", None) or TrustPolicy()


def manifest_where(record: RunRecord) -> str:
    return str(record.run_dir / "record.json")


def load_module(record: RunRecord, step: int = 0, **overrides: Any) -> torch.nn.Module:
    """Rebuild the recorded module from its class path and init args, with the policy of checkpoint ``step``.

    The class path must pass ``record.trust`` (:class:`~lens_callbacks.io.trust.TrustPolicy`) and name a
    ``torch.nn.Module`` subclass with ``credit_terms``; the init args must fit its signature, every parameter
    present. All of it is checked before the class is called.
    """
    where = manifest_where(record)
    for field in ("module", "init_args"):
        if field not in record.manifest:
            raise ValueError(
                f"{where}: field `{field}` is missing; the module cannot be rebuilt without it "
                "(records written by RunRecordCallback hold it)."
            )
    cls = resolve_module_class(record.manifest["module"], _trust(record), where)
    args = (
        dict(record.manifest["init_args"])
        if isinstance(record.manifest["init_args"], dict)
        else record.manifest["init_args"]
    )
    if isinstance(args, dict):
        args.update(overrides)
    args = check_init_args(cls, args, where)
    builder = record.manifest.get("batch_builder")
    if builder:  # checked now, before the module's own code runs
        resolve_batch_builder(builder, _trust(record), where)
    state = record.load_policy(step)
    check_sizes_against_checkpoint(cls, args, state, where, record, step)
    try:
        module = cls(**args)
    except Exception as err:
        raise ValueError(
            f"{where}: building {cls.__qualname__} from `init_args` failed ({type(err).__name__}: "
            f"{one_line(str(err), 300)})."
        ) from None
    _load_policy_into(module, record, step, state)
    return module


#: init args that size a module (``n_embd``, ``n_layer``, ``vocab_size``, ``hidden_size``, ``d_model`` ...).
_SIZE_NAME = re.compile(
    r"^(n_(layer|layers|embd|embed|head|heads|positions|inner|ctx|kv_heads)|"
    r"num_(layers|hidden_layers|heads|attention_heads|key_value_heads|experts)|"
    r"(hidden|intermediate|vocab|embed|embedding|model|ffn|head)_(size|dim)|d_(model|ff|head)|"
    r"max_position_embeddings)$"
)
#: init args that count repeated blocks (layers, experts): each one is tensors of its own in the checkpoint.
_COUNT_NAME = re.compile(r"^(n_(layer|layers)|num_(layers|hidden_layers|experts))$")


def _block_count(state: dict) -> int:
    """How many repeated blocks the checkpoint holds tensors for: the distinct indices in its keys (``h.3.attn``
    is block 3), counted from what the file holds — never from a size a tensor declares."""
    seen = {c for k in state for c in str(k).split(".") if c.isdigit() and len(c) <= 9}
    return max(1, len(seen))


def check_sizes_against_checkpoint(
    cls: type, args: dict, state: dict, where: str, record: RunRecord, step: int
) -> None:
    """The module ``init_args`` describe must be the checkpoint's, checked before anything is built for real.

    First, without building: an init arg named like a size (``n_embd``, ``n_layer``, ``*_size`` ...) cannot exceed
    every tensor dimension and the tensor count of the checkpoint (``n_layer: 200000`` or ``n_embd: 4096`` beside
    a 32-wide checkpoint). Then the module is built on the ``meta`` device (no memory for its weights; the RNG
    left as it was) and its state dict's names and shapes compared with the checkpoint's. A module that cannot
    be built on ``meta`` is only bounded by the first check.
    """
    from ..io.records import policy_path

    ckpt = policy_path(record.run_dir, step)
    dims = [int(d) for v in state.values() for d in v.shape]
    ceiling = max([len(state), *dims]) if state else 0
    blocks = _block_count(state)
    for name, v in args.items():
        if not isinstance(v, int) or isinstance(v, bool) or not _SIZE_NAME.search(name):
            continue
        if _COUNT_NAME.search(name) and v > blocks:
            # a count of blocks is bounded by the blocks the file holds tensors for: one large tensor added to the
            # checkpoint lifts the dimensions' ceiling, not this one
            raise ValueError(
                f"{where}: field `init_args.{name}` is {shown_value(v)}, more blocks than {ckpt} holds tensors for "
                f"({blocks:,} distinct indices in its keys): the module it builds is not the checkpoint's; nothing "
                "was built."
            )
        if v > ceiling:
            raise ValueError(
                f"{where}: field `init_args.{name}` is {shown_value(v)}, larger than every dimension and the tensor count "
                f"of {ckpt} (at most {ceiling:,}): the module it builds is not the checkpoint's; nothing was built."
            )
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            probe = cls(**args)
        shapes = {k: tuple(v.shape) for k, v in probe.state_dict().items()}
    except Exception:  # code that cannot run on meta: the bound above is the check
        return
    finally:
        probe = None
    fit = f"{ckpt}: the policy checkpoint does not fit the module that field `init_args` of {where} describes"
    for k, shape in shapes.items():
        if k not in state:
            raise ValueError(f"{fit} (Missing key `{_short_key(k)}` of shape {list(shape)}); nothing was built.")
        if tuple(state[k].shape) != shape:
            raise ValueError(
                f"{fit} (size mismatch for `{_short_key(k)}`: the checkpoint holds {list(state[k].shape)}, the init "
                f"args build {list(shape)}); nothing was built."
            )
    extra = [k for k in state if k not in shapes]
    if extra:
        raise ValueError(f"{fit} (Unexpected key `{_short_key(extra[0])}`); nothing was built.")


def _short_key(k: str) -> str:
    return k if len(k) <= 120 else k[:117] + "..."


def _load_policy_into(module: torch.nn.Module, record: RunRecord, step: int, state: Optional[dict] = None) -> None:
    from ..io.records import policy_path

    state = record.load_policy(step) if state is None else state
    try:
        module.load_state_dict(state)
    except Exception as err:  # missing/unexpected keys, wrong shapes
        raise ValueError(
            f"{policy_path(record.run_dir, step)}: the policy checkpoint does not fit {type(module).__name__} "
            f"({type(err).__name__}: {one_line(str(err), 400)})."
        ) from None


def _vocab_size(module: torch.nn.Module) -> Optional[int]:
    """The policy's vocabulary: its input embeddings' rows (Hugging Face), else its first ``nn.Embedding``."""
    for m in module.modules():
        get = getattr(m, "get_input_embeddings", None)
        if callable(get):
            try:
                emb = get()
            except Exception:  # not every module that has the method implements it
                continue
            if isinstance(emb, torch.nn.Embedding):
                return int(emb.num_embeddings)
    for m in module.modules():
        if isinstance(m, torch.nn.Embedding):
            return int(m.num_embeddings)
    return None


def _max_positions(module: torch.nn.Module) -> Optional[int]:
    """The longest sequence the policy embeds (a Hugging Face config's ``n_positions`` / ``max_position_embeddings``)."""
    for m in module.modules():
        cfg = getattr(m, "config", None)
        for name in ("n_positions", "max_position_embeddings"):
            v = getattr(cfg, name, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


#: The longest text turn, in characters per position of the policy: a text turn is tokenised before it is
#: checked, and no tokenizer makes fewer than one token of this many characters.
TEXT_CHARS_PER_POSITION = 64
#: Bytes per position and vocabulary entry a forward and backward hold at once (float32 logits, their
#: log-softmax, the gradient of each).
LOGIT_BYTES = 16
#: Bytes per position, hidden unit and layer a forward and backward hold (activations kept for the backward).
ACTIVATION_BYTES = 64


def _hidden_and_layers(module: torch.nn.Module) -> tuple[int, int]:
    """The policy's embedding width and its repeated blocks (the distinct indices of its parameter names)."""
    width = 1
    for m in module.modules():
        if isinstance(m, torch.nn.Embedding):
            width = max(width, int(m.embedding_dim))
    blocks = {c for name, _ in module.named_parameters() for c in name.split(".") if c.isdigit() and len(c) <= 9}
    return width, max(1, len(blocks))


def _turn_length(module: torch.nn.Module, turn: Any, positions: Optional[int], where: str) -> int:
    """The tokens a turn holds: its ids, or its text tokenised by the module's tokenizer (or its UTF-8 bytes, an
    upper bound for byte-level tokenizers) once its length is bounded by the policy's positions."""
    if turn.token_ids is not None:
        return len(turn.token_ids)
    text = turn.text
    if positions is not None and len(text) > TEXT_CHARS_PER_POSITION * positions:
        raise ValueError(
            f"{where}: field `text` holds {len(text):,} characters with `token_ids: null`, more than "
            f"{TEXT_CHARS_PER_POSITION} per position of the policy's {positions:,} positions; record the "
            "turn's token ids, or shorten it."
        )
    tok = getattr(module, "tokenizer", None)
    if callable(tok):
        try:
            ids = tok(text)["input_ids"]
            return len(ids)
        except Exception:  # the builder names its own failure; here the bytes bound the count
            pass
    return len(text.encode("utf-8", "surrogatepass"))


def check_token_ids(
    module: torch.nn.Module,
    trajectories: Sequence[Any],
    where: str,
    limits: Optional[ReadLimits] = None,
    what: str = "the batch",
) -> None:
    """Refuse what the policy cannot embed, before anything is built from it: token ids outside its vocabulary,
    sequences (text turns tokenised) longer than its positions, and a padded batch whose forward and backward
    would hold more than the memory budget (``LENS_MEMORY_MB``: rows × longest row × (vocabulary + hidden ×
    layers) bytes, counted from the trajectories the reader has checked)."""
    vocab = _vocab_size(module)
    positions = _max_positions(module)
    longest = 0
    for k, traj in enumerate(trajectories):
        total = 0
        for j, turn in enumerate(traj.turns):
            ids = turn.token_ids or ()
            bad = [i for i in ids if i < 0 or (vocab is not None and i >= vocab)]
            if bad:
                raise ValueError(
                    f"{where}, trajectory {k}, turn {j}: field `token_ids` holds {shown_value(bad[0])}, outside the policy's "
                    f"vocabulary 0..{vocab - 1 if vocab is not None else '?'}."
                )
            total += _turn_length(module, turn, positions, f"{where}, trajectory {k}, turn {j}")
        if positions is not None and total > positions:
            raise ValueError(
                f"{where}, trajectory {k}: its turns hold {total:,} tokens (field `token_ids`, or `text` "
                f"tokenised), more than the policy's {positions:,} positions."
            )
        longest = max(longest, total)
    limits = limits or ReadLimits.from_env()
    width, layers = _hidden_and_layers(module)
    need = len(trajectories) * longest * (LOGIT_BYTES * (vocab or 1) + ACTIVATION_BYTES * width * layers)
    if need > limits.memory_bytes:
        raise ValueError(
            f"{where}: {what} pads {len(trajectories):,} trajectories to {longest:,} positions, whose forward and "
            f"backward would hold about {need / (1 << 20):,.0f} MiB (vocabulary {vocab or '?'}, width {width}, "
            f"{layers} blocks), beyond the memory budget of {limits.memory_bytes / (1 << 20):,.0f} MiB "
            "(LENS_MEMORY_MB); nothing was built. Raise LENS_MEMORY_MB only for a file you trust."
        )


def check_part_count(n_parts: int, where: str, field: str, limits: Optional[ReadLimits] = None) -> None:
    """Refuse an audit whose parts' ``m × m`` interference matrix (float64, with the engines' copies of it) would
    pass the memory budget, before any part is built."""
    limits = limits or ReadLimits.from_env()
    need = 32 * n_parts * n_parts
    if need > limits.memory_bytes:
        most = int((limits.memory_bytes / 32) ** 0.5)
        raise ValueError(
            f"{where}: field `{field}` makes {n_parts:,} parts; their {n_parts:,} x {n_parts:,} interference "
            f"matrix would need {need / (1 << 20):,.0f} MiB, beyond the memory budget "
            f"(LENS_MEMORY_MB = {limits.memory_bytes / (1 << 20):,.0f} MiB, at most {most:,} parts); nothing was "
            "built. Audit a coarser partition (by_group), or raise LENS_MEMORY_MB for a file you trust."
        )


class PartCountBound:
    """A partition whose part count is checked (:func:`check_part_count`) before the engine builds a gradient per
    part or their ``m × m`` interference matrix: the parts of the partition asked for, not the rollouts."""

    def __init__(self, fn: Any, where: str, limits: ReadLimits) -> None:
        self.fn, self.where, self.limits = fn, where, limits
        self.__name__ = getattr(fn, "__name__", "custom")

    def __call__(self, terms: Any) -> Any:
        part = self.fn if isinstance(self.fn, Partition) else self.fn(terms)
        if isinstance(part, Partition):
            check_part_count(len(part.names), self.where, "trajectories", self.limits)
        return part


def check_built_positions(module: torch.nn.Module, batch: Any, where: str) -> None:
    """The built batch's rows against the policy's positions (a template's tokens are only counted here)."""
    positions = _max_positions(module)
    ids = batch.get("input_ids") if isinstance(batch, dict) else getattr(batch, "input_ids", None)
    if positions is not None and isinstance(ids, torch.Tensor) and ids.dim() >= 1 and ids.shape[-1] > positions:
        raise ValueError(
            f"{where}: the batch built from its trajectories holds rows of {ids.shape[-1]:,} tokens, more "
            f"than the policy's {positions:,} positions; shorten the turns."
        )


def make_optimizer(module: torch.nn.Module) -> torch.optim.Optimizer:
    out = module.configure_optimizers()
    if isinstance(out, dict):
        out = out["optimizer"]
    if isinstance(out, (list, tuple)):
        out = out[0]
        if isinstance(out, (list, tuple)):
            out = out[0]
        if isinstance(out, dict):
            out = out["optimizer"]
    if not isinstance(out, torch.optim.Optimizer):
        raise ValueError(
            f"`configure_optimizers` must give a torch.optim.Optimizer to replay, got {type(out).__name__}."
        )
    return out


def stateless_optimizer(opt: torch.optim.Optimizer) -> bool:
    """Plain SGD (no momentum) carries no state between steps, so a replay may start at any checkpoint."""
    return type(opt) is torch.optim.SGD and all(g.get("momentum", 0) == 0 for g in opt.param_groups)


def replay_blocker(record: RunRecord, opt: torch.optim.Optimizer) -> Optional[Refusal]:
    man = record.manifest
    tr = man.get("trainer", {})
    if tr.get("gradient_clip_val") not in (None, 0, 0.0) and (tr.get("gradient_clip_algorithm") or "norm") not in (
        "norm",
        "value",
    ):
        return Refusal(
            "gradient_clip_algorithm",
            f"training clipped gradients with {shown_value(tr['gradient_clip_algorithm'])}, which the replay "
            "does not know.",
            remedy="record with checkpoint_every=1 and audit at a checkpoint",
        )
    if int(tr.get("world_size", 1)) != 1:
        return Refusal(
            "world_size",
            f"training ran on {tr['world_size']} processes; the replay of an averaged DDP step is not exact.",
            remedy="record with checkpoint_every=1 and audit at a checkpoint",
        )
    if str(tr.get("precision", "32-true")) not in ("32-true", "32", "64-true", "64"):
        return Refusal(
            "precision",
            f"training ran at precision {shown_value(tr['precision'])}; the replay runs at full precision.",
            remedy="record with checkpoint_every=1 and audit at a checkpoint",
        )
    recorded = man.get("optimizer") or []
    if recorded:
        cls = recorded[0].get("class", "")
        mine = f"{type(opt).__module__}.{type(opt).__qualname__}"
        if cls != mine:
            return Refusal(
                "optimizer",
                f"the record's optimizer is {shown_value(cls)}, the rebuilt module's is {mine!r}.",
                remedy="audit with the module code the run was trained with, or at a checkpoint",
            )
        for i, (rg, g) in enumerate(zip(recorded[0].get("param_groups", []), opt.param_groups)):
            for k in ("lr", "momentum", "weight_decay", "dampening", "nesterov", "betas", "eps"):
                if k in rg and k in g and _plain_value(g[k]) != rg[k]:
                    return Refusal(
                        "optimizer",
                        f"param group {i}: `{k}` is {shown_value(rg[k])} in the record, {g[k]!r} in the rebuilt optimizer.",
                        remedy="audit with the module code the run was trained with, or at a checkpoint",
                    )
    return None


def _clip_like_lightning(opt: torch.optim.Optimizer, clip_val: Optional[float], algorithm: str) -> None:
    """Lightning's default ``configure_gradient_clipping``: the optimizer's parameters, in group order."""
    if not clip_val or clip_val <= 0:
        return
    params = [p for g in opt.param_groups for p in g["params"]]
    if algorithm == "value":
        torch.nn.utils.clip_grad_value_(params, clip_value=clip_val)
    else:
        torch.nn.utils.clip_grad_norm_(params, clip_val)


def _plain_value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.tolist()
    if isinstance(v, tuple):
        v = list(v)
    return v


def set_recorded_lrs(record: RunRecord, step: int, opt: torch.optim.Optimizer) -> None:
    """Give ``opt`` the learning rates step ``step`` used (an LR scheduler may have moved them); a list of the wrong
    length is an error naming the field, never a silently different update."""
    lrs = record.step_meta(step).get("lr")
    if lrs is None:
        return
    if len(lrs) != len(opt.param_groups):
        from ..io.records import meta_path

        raise ValueError(
            f"{meta_path(record.run_dir, step)}: field `lr` holds {len(lrs)} rates, but the rebuilt optimizer has "
            f"{len(opt.param_groups)} param groups; re-record the step with the module's own optimizer."
        )
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr


def rebuild_batch(module: torch.nn.Module, record: RunRecord, step: int) -> Any:
    """The module's rollout batch of a recorded step (``make_rollout_batch`` or the record's builder), checked
    before it is built (:func:`check_token_ids`) and after (its rows' length)."""
    trajs = record.trajectories(step)
    where = step_path(record.run_dir, step)
    check_token_ids(module, trajs, str(where), record.limits, "the step's batch")
    meta = record.step_meta(step)
    builder = record.manifest.get("batch_builder")
    if builder:
        fn = resolve_batch_builder(builder, _trust(record), manifest_where(record))
        try:
            batch = fn(module, trajs, meta)
        except Exception as err:  # trusted code, but not this module's builder
            raise ValueError(
                f"{manifest_where(record)}: field `batch_builder` ({builder}) failed on the trajectories of {where} "
                f"with {type(module).__name__} ({type(err).__name__}: {one_line(str(err), 300)})."
            ) from None
    else:
        make = getattr(module, "make_rollout_batch", None)
        if make is None:
            raise ValueError(
                f"{type(module).__name__} has no `make_rollout_batch(trajectories)` and the record names no `batch_builder`; "
                "record with RunRecordCallback(batch_builder='pkg.mod.fn')."
            )
        try:
            batch = make(trajs)
        except Exception as err:
            raise ValueError(
                f"{where}: {type(module).__name__}.make_rollout_batch failed on the recorded trajectories "
                f"({type(err).__name__}: {one_line(str(err), 300)})."
            ) from None
    check_built_positions(module, batch, str(where))
    return batch


def _dropout_blocker(record: RunRecord, steps: Sequence[int]) -> Optional[Refusal]:
    dropout = record.manifest.get("init_args", {}).get("dropout", 0.0)
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or float(dropout) <= 0.0:
        return None
    unseeded = [s for s in steps if "dropout_seed" not in record.step_meta(s)]
    if unseeded:
        return Refusal(
            "dropout",
            f"training used dropout and steps {unseeded[:5]} carry no recorded dropout seed, so "
            "their masks cannot be drawn again.",
            {"n_unseeded": len(unseeded)},
            remedy="train with dropout=0, have the module keep `last_rollout_batch.dropout_seed`, or record with checkpoint_every=1",
        )
    return None


def _with_policy(record: RunRecord, step: int, module: Optional[torch.nn.Module]) -> torch.nn.Module:
    """``module`` (rebuilt from the record when None) holding the policy of checkpoint ``step``."""
    if module is None:
        return load_module(record, step)
    _load_policy_into(module, record, step)
    return module


def _missing_steps(steps: Sequence[int], start: int, step: int, shown: int = 5) -> tuple[int, list[int]]:
    """How many of ``start .. step - 1`` the record lacks, and the first ``shown`` of them: work in the number of
    recorded steps, never in the distance between two step numbers (``step`` may be 10**12)."""
    inside = sorted({s for s in steps if start <= s < step})
    n_missing = (step - start) - len(inside)
    first: list[int] = []
    expect = start
    for s in inside + [step]:
        while expect < s and len(first) < shown:
            first.append(expect)
            expect += 1
        if len(first) >= shown:
            break
        expect = s + 1
    return n_missing, first


def replay_to(
    record: RunRecord, step: int, module: Optional[torch.nn.Module] = None, progress: bool = True
) -> Union[torch.nn.Module, Refusal]:
    """The recorded module with the weights it had at ``step`` (loaded, or replayed from a checkpoint)."""
    if step in record.checkpoints:
        return _with_policy(record, step, module)
    start = record.nearest_checkpoint(step)
    m = _with_policy(record, start, module)
    opt = make_optimizer(m)
    blocker = replay_blocker(record, opt)
    if blocker is not None:
        return blocker
    if not stateless_optimizer(opt) and start != 0:
        start = 0
        _load_policy_into(m, record, 0)
    n_missing, missing = _missing_steps(record.steps, start, step)
    if n_missing:
        return Refusal(
            "missing_steps",
            f"steps {missing} between checkpoint {start} and step {step} are not recorded.",
            {"start": start, "step": step, "n_missing": n_missing},
            remedy="record every step (RunRecordCallback on the whole run), or audit at a checkpoint",
        )
    record.check_step_files(range(start, step))
    blocker = _dropout_blocker(record, range(start, step))
    if blocker is not None:
        return blocker
    if not record.manifest.get("batch_builder") and not hasattr(m, "make_rollout_batch"):
        return Refusal(
            "make_rollout_batch",
            f"{type(m).__name__} has no `make_rollout_batch(trajectories)` and the record names no `batch_builder`.",
            remedy="give the module make_rollout_batch, or record with RunRecordCallback(batch_builder='pkg.mod.fn')",
        )
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    steps = range(start, step)
    it = tqdm(steps, desc=f"replay {start}->{step}", disable=not progress, leave=False) if tqdm else steps
    tr = record.manifest.get("trainer", {})
    clip_val, clip_algo = tr.get("gradient_clip_val"), tr.get("gradient_clip_algorithm") or "norm"
    m.train()
    with torch.random.fork_rng():
        for s in it:
            batch = rebuild_batch(m, record, s)
            set_recorded_lrs(record, s, opt)
            opt.zero_grad(set_to_none=True)
            try:
                loss = m.credit_terms(batch).terms.sum()
                loss.backward()
            except Exception as err:  # the module's own code on a batch it rebuilt: name the step it failed on
                raise ValueError(
                    f"{step_path(record.run_dir, s)}: replaying the step failed in {type(m).__name__}.credit_terms "
                    f"({type(err).__name__}: {one_line(str(err), 300)})."
                ) from None
            _clip_like_lightning(opt, clip_val, clip_algo)
            try:
                opt.step()
            except (
                RuntimeError,
                OverflowError,
            ) as err:  # an lr that overflows the weights' dtype: no weights, no reading
                if "overflow" not in str(err):
                    raise
                return Refusal(
                    "non_finite_update",
                    f"replaying step {s} overflowed the weights' dtype "
                    f"({one_line(str(err), 200)}); the weights at step {step} cannot be rebuilt.",
                    {"step": s, "lr": [g["lr"] for g in opt.param_groups]},
                    remedy="check field `lr` of the step's metadata (steps/step_NNNNNN.json)",
                )
    opt.zero_grad(set_to_none=True)
    return m
