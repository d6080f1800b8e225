r"""TRL's fused LM head, seen by the one-pass engine's capture.

TRL's ``GRPOTrainer`` scores completions with ``ChunkedLogProbFunction``: per-token log-probabilities of
``hidden @ lm_head.weightᵀ`` computed tile by tile, the ``[N, V]`` logits never materialised and the LM
head never called as a layer. No module hook sees it, so a run that trains the head could not ride along.

The head is still a ``Linear`` use: its weight gradient is ``Σ_t z'_t ⊗ h_t`` with ``h_t`` the hidden
state the function reads and ``z'_t`` the gradient at the logits, which TRL's backward forms tile by tile
and discards. :class:`FusedHeadCapture`, an extension installed with every
:class:`~lens_callbacks.credit.engines.ghost.RowCapture` once this module is imported (the riding-along
capture and the separate pass's alike), replaces the function while the capture is installed by a
subclass whose forward is TRL's and whose backward is TRL's own backward, run with TRL's tile fold
wrapped so each folded tile — the logits' gradient — is also copied out. It records the use: the hidden
states as the layer's input ``A`` (``[B, n, d]``) and those tiles as ``B`` (``[B, n, V]``). The engine
then reads the head as it reads any ``Linear`` (:class:`FusedHeadRule`): dots, norms, the cross term with
a tied embedding's use, the parts' sum. Nothing TRL computes changes: the forward and the backward are
TRL's code, and the wrapped fold returns what TRL's returns, after one copy of the tile.

Cost: one copy of each tile in the backward, and the ``[N, V]`` logits gradient held until the head's
parameters are read.

Only the layout TRL uses off Triton devices is covered: every position scored, ``N = B · n``. On a
Triton device TRL scores only the positions whose label is set (``hidden[mask]``), which loses the rows;
:func:`fused_head_refusal` says so: a ride takes the separate pass, where the engine reads the head
by its exact per-part fallback.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import nn

from ..credit.engines.ghost import CAPTURE_EXTENSIONS, RowCapture
from ..credit.engines.rules.linear import LinearRule

__all__ = ["FusedHeadRule", "FUSED_HEAD", "FusedHeadCapture", "fused_head_refusal", "head_captures"]


class FusedHeadRule(LinearRule):
    """The LM head as TRL's fused function uses it: a ``Linear`` use recorded by :class:`FusedHeadCapture`
    (no module is ever hooked for it)."""

    name = "fused_lm_head"

    def matches(self, mod: nn.Module) -> bool:
        return False


FUSED_HEAD = FusedHeadRule()


def _kernel() -> Any:
    from trl.kernels import chunked_logprob

    return chunked_logprob


def fused_head_refusal(device: torch.device) -> Optional[str]:
    """Why a trained LM head cannot ride along on ``device`` (None: it can)."""
    try:
        triton = bool(_kernel()._use_triton(device))
    except Exception as e:  # a TRL without the function: the capture would see nothing
        return f"TRL's fused LM head could not be inspected ({type(e).__name__}: {e})"
    if triton:
        return (
            "the LM head is trained and, on a Triton device, TRL's fused LM head scores only the positions whose "
            "label is set, so its hidden states no longer say which row they came from (a run whose LM head is "
            "frozen, e.g. a LoRA adapter, rides along)"
        )
    return None


class _TileSink:
    """The logits gradient ``[N, V]``, filled while TRL's backward folds each tile (TRL's own code, unchanged)."""

    def __init__(self, targets: torch.Tensor, n: int, v: int, dtype: torch.dtype) -> None:
        self.targets = targets  # [N] the function's saved targets: a tile's targets are a slice of them
        self.out = torch.empty((n, v), dtype=dtype, device=targets.device)  # [N, V]
        self.error: Optional[BaseException] = None

    def wrap(self, fold: Any) -> Any:
        def recording_fold(tile: torch.Tensor, stride: int, targets: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            ret = fold(tile, stride, targets, *args, **kwargs)  # the tile is now the logits' gradient
            if self.error is None:
                try:
                    self._keep(tile, targets, int(args[4]))  # vocab_start: after log_z, entropy and the two grads
                except Exception as e:  # inside TRL's backward: kept, never raised
                    self.error = e
            return ret

        return recording_fold

    def _keep(self, tile: torch.Tensor, targets: torch.Tensor, v0: int) -> None:
        base = self.targets
        if targets.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
            raise RuntimeError("TRL's backward folded a tile whose targets are not the saved ones")
        t0 = (targets.storage_offset() - base.storage_offset()) // base.stride(0)
        self.out[t0 : t0 + tile.shape[0], v0 : v0 + tile.shape[1]].copy_(tile)


_RECORDING: Any = None


def _recording_function() -> Any:
    """TRL's ``ChunkedLogProbFunction`` whose backward, for a call the capture marked, is TRL's own backward
    with each folded tile also copied out (the tile fold looked up in TRL's module is wrapped for the call)."""
    global _RECORDING
    if _RECORDING is None:
        k = _kernel()
        base = k.ChunkedLogProbFunction

        class RecordingChunkedLogProb(base):  # type: ignore[misc, valid-type]
            @staticmethod
            def backward(ctx: Any, *grads: Any) -> Any:
                on_tiles = getattr(ctx, "lens_on_tiles", None)
                if on_tiles is None:
                    return base.backward(ctx, *grads)
                fold = k._backward_tile
                try:
                    hidden, weight, _, targets, _, _ = ctx.saved_tensors
                    sink = _TileSink(targets, int(hidden.shape[0]), int(weight.shape[0]), ctx.compute_dtype)
                    recording = sink.wrap(fold)
                except Exception as e:  # read by the ride's check, never raised into the training backward
                    on_tiles(None, e)
                    return base.backward(ctx, *grads)
                k._backward_tile = recording
                try:
                    out = base.backward(ctx, *grads)
                finally:
                    k._backward_tile = fold
                on_tiles(sink.out if sink.error is None else None, sink.error)
                return out

        _RECORDING = RecordingChunkedLogProb
    return _RECORDING


class FusedHeadCapture:
    """A :class:`RowCapture` extension: while the capture is installed, TRL's fused-head function is
    replaced by :func:`_recording_function`'s subclass, and each call made while the capture is active, on
    a trained weight of a module under the capture's root, with an output that needs grad, records one use
    of that module (the model's output embeddings where the weight is theirs — a tied head, not its
    embedding). Rows: the capture's batch (the leading size its layers saw), or the call's
    :func:`~lens_callbacks.credit.engines.ghost.batch_rows` span. A second call in one installation (in one
    span) is not recorded (``error`` says why): the engine then finds a use it did not see and reads
    that weight by its exact fallback, or the ride falls back with the reason."""

    def __init__(self, capture: RowCapture) -> None:
        self.capture = capture
        self._error: list[Optional[str]] = [None]  # the first error, shared with the tile callbacks
        self.calls = 0  # calls recorded (the function's calls on a covered weight with grad)
        self._spans: set = set()  # the `batch_rows` spans a call was recorded in
        self._owners: Optional[dict[int, nn.Module]] = None
        self._utils: Any = None
        self.unavailable: Optional[str] = None  # why TRL's function could not be wrapped
        try:
            import trl.trainer.utils as utils

            self._fn = _recording_function()
            self._orig = utils._ChunkedLogProbFunction
        except Exception as e:  # nothing patched: a trained head is read by the engine's exact fallback
            self.unavailable = f"{type(e).__name__}: {e}"
            return
        self._utils = utils
        utils._ChunkedLogProbFunction = self

    @property
    def error(self) -> Optional[str]:
        """Why a call was not recorded (or its tiles not read), the first reason; None while all is well."""
        return self._error[0]

    @error.setter
    def error(self, value: Optional[str]) -> None:
        self._error[0] = value

    def remove(self) -> None:
        if self._utils is None:
            return
        top = self._utils._ChunkedLogProbFunction
        if top is self:
            self._utils._ChunkedLogProbFunction = self._orig
        else:  # a capture installed after this one is still in place: take this one out of the chain below it
            while isinstance(top, FusedHeadCapture) and top._orig is not self:
                top = top._orig
            if isinstance(top, FusedHeadCapture):
                top._orig = self._orig
        self._utils = None

    def apply(self, *args: Any) -> Any:
        # TRL's forward and, unless this call is recorded, TRL's backward: the same arithmetic
        out = self._fn.apply(*args)
        try:
            self._record(args[0], args[1], args[2], out)
        except Exception as e:  # never raised into the training forward
            self.error = self.error or f"{type(e).__name__}: {e}"
        return out

    def _owner(self, weight: torch.Tensor) -> Optional[nn.Module]:
        if self._owners is None:
            owners: dict[int, nn.Module] = {}
            root = self.capture.root
            for mod in root.modules():
                w = getattr(mod, "weight", None)
                if isinstance(w, torch.Tensor) and id(w) not in owners and not isinstance(mod, nn.Embedding):
                    owners[id(w)] = mod
            for mod in root.modules():  # the output embeddings own their weight, tied or not
                get = getattr(mod, "get_output_embeddings", None)
                head = get() if callable(get) else None
                if isinstance(getattr(head, "weight", None), torch.Tensor):
                    owners[id(head.weight)] = head
            self._owners = owners
        return self._owners.get(id(weight))

    def _record(self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out: Any) -> None:
        cap = self.capture
        if not cap.active or cap._inner:
            return
        logp = out[0]
        if not isinstance(logp, torch.Tensor) or not logp.requires_grad or logp.grad_fn is None:
            return
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in (weight, bias)):
            return
        head = self._owner(weight)
        if head is None:
            return  # a weight outside the capture's root (a reference model's head)
        if fused_head_refusal(hidden.device) is not None:  # only the labelled positions: the rows are lost
            raise ValueError("TRL's fused LM head scores only the labelled positions on a Triton device")
        self.calls += 1
        # A forward split into chunks of rows: no call holds the batch's rows in order, unless each chunk
        # says which rows it holds (`batch_rows`, one call per span; the engine stacks them).
        if cap.span is None and self.calls > 1 or cap.span is not None and cap.span in self._spans:
            raise ValueError(
                f"TRL's fused LM head ran {self.calls} times in one forward; reading it needs one call per batch "
                "(or per `batch_rows` span)"
            )
        self._spans.add(cap.span)
        rows = int(cap.rows()) if cap.span is not None else max(int(cap.batch), 1)
        if rows < 1:
            raise ValueError(
                f"the `batch_rows` span {cap.span} does not hold the {cap._last} rows the layers before the head saw"
            )
        N, d = int(hidden.shape[0]), int(hidden.shape[-1])
        if N % rows:
            raise ValueError(
                f"TRL's fused LM head scored {N} positions, not a whole number per row of the batch's {rows}"
            )
        use = cap.record(FUSED_HEAD, head, weight, bias, hidden.reshape(rows, N // rows, d))  # A: [B, n, d]
        # A backward to the head's input runs the function's backward, which forms the tiles (a backward
        # to its output would stop short of them).
        use.edge = torch.autograd.graph.get_gradient_edge(hidden) if hidden.requires_grad else None

        # The graph's node holds this function for as long as anything holds the node (TRL's outputs, a ride
        # holding them): it reaches the use by a weak reference (the capture holds it while it is read) and this
        # extension only through its error box, so no capture outlives its reading through the graph.
        used, box = weakref.ref(use), self._error

        def on_tiles(z: Optional[torch.Tensor], err: Optional[BaseException]) -> None:
            if err is not None:
                box[0] = box[0] or f"{type(err).__name__}: {err}"
                return
            use_ = used()
            if use_ is not None and not use_.sealed and box[0] is None:
                use_.grad_hook(z.reshape(rows, N // rows, z.shape[-1]))  # B: [B, n, V]

        logp.grad_fn.lens_on_tiles = on_tiles


def head_captures(capture: RowCapture) -> list[FusedHeadCapture]:
    """The fused-head extensions installed with ``capture``."""
    return [h for h in capture.handles if isinstance(h, FusedHeadCapture)]


if FusedHeadCapture not in CAPTURE_EXTENSIONS:
    CAPTURE_EXTENSIONS.append(FusedHeadCapture)
