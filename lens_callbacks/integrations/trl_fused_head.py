r"""TRL's fused LM head, seen by the one-pass engine's capture.

TRL's ``GRPOTrainer`` scores completions with ``ChunkedLogProbFunction``: per-token log-probabilities of
``hidden @ lm_head.weightᵀ`` computed tile by tile, the ``[N, V]`` logits never materialised and the LM
head never called as a layer. No module hook sees it, so a run that trains the head could not ride along.

The head is still a ``Linear`` use: its weight gradient is ``Σ_t z'_t ⊗ h_t`` with ``h_t`` the hidden
state the function reads and ``z'_t`` the gradient at the logits, which TRL's backward forms tile by tile
and discards. :class:`FusedHeadCapture` replaces the function, for one training forward, by a wrapper that
calls TRL's own function unchanged and records the use: the hidden states as the layer's input ``A``
(``[B, n, d]``) and, from a pre-hook on the function's backward node, the logits gradient as ``B``
(``[B, n, V]``), recomputed with TRL's own tile code from the output gradients that backward receives.
The engine then reads the head as it reads any ``Linear`` (:class:`FusedHeadRule`): dots, norms, the
cross term with a tied embedding's use, the parts' sum. Nothing returned to TRL changes: the wrapper
returns the function's outputs and the pre-hook returns no new gradient.

Cost: one more pass over the head's tiles in the backward (a ``[N, d] × [d, V]`` product and TRL's fold)
and the ``[N, V]`` logits gradient held until the head's parameters are read.

Only the layout TRL uses off Triton devices is covered: every position scored, ``N = B · n``. On a
Triton device TRL scores only the positions whose label is set (``hidden[mask]``), which loses the rows;
:func:`fused_head_refusal` says so and the step takes the separate pass.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..credit.engines.ghost import RowCapture
from ..credit.engines.rules.linear import LinearRule

__all__ = ["FusedHeadRule", "FUSED_HEAD", "FusedHeadCapture", "fused_logits_grad", "fused_head_refusal"]


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


@torch.no_grad()
def fused_logits_grad(node: Any, grad_logprobs: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor]) -> torch.Tensor:
    """``[N, V]``: the gradient at the logits that TRL's backward forms, tile by tile, from ``node``'s saved
    tensors and the output gradients it receives (None where no gradient reaches an output)."""
    k = _kernel()
    hidden, weight, bias, targets, log_z, entropy = node.saved_tensors
    dtype, chunk, kernel_args = node.compute_dtype, int(node.chunk_size), node.kernel_args
    N, V = int(hidden.shape[0]), int(weight.shape[0])
    out = torch.empty((N, V), dtype=dtype, device=hidden.device)  # [N, V]
    glp = grad_logprobs.float().contiguous() if grad_logprobs is not None else None  # [N]
    gent = grad_entropy.float().contiguous() if grad_entropy is not None else None  # [N]
    step = int(k.TOKEN_CHUNK_SIZE)
    for t0 in range(0, N, step):
        t1 = min(t0 + step, N)
        h = hidden[t0:t1].to(dtype)  # [n, d]
        for v0 in range(0, V, chunk):
            v1 = min(v0 + chunk, V)
            tile = out[t0:t1, v0:v1]  # [n, c]
            torch.mm(h, weight[v0:v1].to(dtype).t(), out=tile)
            if bias is not None:
                tile.add_(bias[v0:v1].to(dtype))
            # TRL's own fold turns the logits tile into their gradient in place
            k._backward_tile(
                tile, tile.stride(0), targets[t0:t1], log_z[t0:t1], entropy[t0:t1],
                glp[t0:t1] if glp is not None else log_z[t0:t1], gent[t0:t1] if gent is not None else log_z[t0:t1],
                v0, v1 - v0, HAS_LOGPROB_GRAD=glp is not None, HAS_ENTROPY_GRAD=gent is not None,
                BLOCK_SIZE=k._BLOCK_SIZE, **kernel_args,
            )
    return out


class FusedHeadCapture:
    """For one forward: TRL's fused-head function replaced by a wrapper that records the head's use on
    ``capture`` (when the capture is active, the function reads ``head``'s weight and its output needs
    grad). ``rows``: the micro-batch's rows (``N`` must be ``rows · n``). ``error`` holds what went wrong
    while recording; the use is then missing and the step falls back with the engine's own reason."""

    def __init__(self, capture: RowCapture, head: nn.Module, rows: int) -> None:
        self.capture = capture
        self.head = head
        self.rows = int(rows)
        self.error: Optional[str] = None
        self._fn: Any = None
        self._utils: Any = None

    def __enter__(self) -> "FusedHeadCapture":
        import trl.trainer.utils as utils

        self._utils, self._fn = utils, utils._ChunkedLogProbFunction
        utils._ChunkedLogProbFunction = self
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._utils is not None:
            self._utils._ChunkedLogProbFunction = self._fn
            self._utils = None

    def apply(self, *args: Any) -> Any:
        out = self._fn.apply(*args)  # TRL's function, as TRL called it
        try:
            self._record(args[0], args[1], args[2], out)
        except Exception as e:  # never raised into the training forward
            self.error = f"{type(e).__name__}: {e}"
        return out

    def _record(self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out: Any) -> None:
        cap, head = self.capture, self.head
        if not cap.active or cap._inner or weight is not getattr(head, "weight", None):
            return
        logp = out[0]
        if not isinstance(logp, torch.Tensor) or not logp.requires_grad or logp.grad_fn is None:
            return
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in (weight, bias)):
            return
        N, d = int(hidden.shape[0]), int(hidden.shape[-1])
        if self.rows <= 0 or N % self.rows:
            raise ValueError(f"the fused LM head scored {N} positions, not a whole number per row of the micro-batch's {self.rows}")
        rows = self.rows
        use = cap.record(FUSED_HEAD, head, weight, bias, hidden.reshape(rows, N // rows, d))  # A: [B, n, d]
        node = logp.grad_fn
        use.edge = torch.autograd.graph.get_gradient_edge(logp)

        def on_backward(grad_outputs: tuple) -> None:
            if use.sealed or self.error is not None:
                return None
            try:
                z = fused_logits_grad(node, grad_outputs[0], grad_outputs[1])  # [N, V]
                use.grad_hook(z.reshape(rows, N // rows, z.shape[-1]))  # B: [B, n, V]
            except Exception as e:  # inside TRL's backward: kept for the ride's check, never raised
                self.error = f"{type(e).__name__}: {e}"
            return None

        node.register_prehook(on_backward)
