r"""PowerSGDStrategy: DDP with PowerSGD-compressed gradients, and a counter of the gradient traffic.

The anchor spec's arms run on a comm-efficient base: DDP whose gradients are PowerSGD-compressed
(``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``), so the gradient the anchor's sign corrects is
the compressed one, and "comm bytes must equal arm A's" is meant over all traffic — the compressed gradients
plus the anchor's snapshots and signs. :class:`PowerSGDStrategy` is that base, configurable from YAML with plain
typed arguments; :class:`GradCommCounter` wraps its comm hook and counts, per rank, the values each bucket hands
to all-reduce:

- before ``start_powerSGD_iter`` (the hook's warm-up; ``iter`` counts backward passes, not optimizer steps):
  the whole bucket (vanilla all-reduce);
- after it: for every tensor of the bucket viewed as ``n × m`` (``n = shape[0]``), at rank
  ``r = min(n, m, matrix_approximation_rank)``, the factors ``P`` (``n·r``) and ``Q`` (``m·r``) when
  ``(n + m)·r·min_compression_rate < n·m``, else the tensor itself (biases and small matrices stay
  uncompressed);
- the plain :func:`~torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook`: the bucket.

Bytes are the all-reduce payload (values × element size) one rank contributes; what the wire carries on top of
that depends on the collective's algorithm (a ring all-reduce moves about ``2(W−1)/W`` of it per rank) and is
the same factor for every arm.

Lightning (2.6.6) registers DDP comm hooks only on CUDA devices; torch's DDP runs them on CPU with gloo as well,
so :class:`PowerSGDStrategy` registers its hook on either.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

__all__ = ["PowerSGDStrategy", "GradCommCounter", "counting_hook", "bucket_comm_values"]


def bucket_comm_values(hook: Callable, state: Any, bucket: Any) -> tuple[int, str]:
    """Values one rank hands to all-reduce when ``hook(state, bucket)`` runs now, and which path it takes.

    Read before the hook runs: PowerSGD advances ``state.iter`` inside it.

    Args:
        hook: ``powerSGD_hook`` or ``allreduce_hook``.
        state: the hook's state (a ``PowerSGDState`` for PowerSGD; ignored for all-reduce).
        bucket: the DDP ``GradBucket``.

    Returns:
        ``(values, path)``: ``path`` is ``"allreduce"``, ``"warmup"`` (PowerSGD before ``start_powerSGD_iter``)
        or ``"powersgd"``.
    """
    if hook is default_hooks.allreduce_hook:
        return int(bucket.buffer().numel()), "allreduce"
    if hook is powerSGD_hook:
        if state.iter < state.start_powerSGD_iter:
            return int(bucket.buffer().numel()), "warmup"
        values = 0
        for g in bucket.gradients():
            n = int(g.shape[0])
            m = g.numel() // n
            r = min(n, m, state.matrix_approximation_rank)
            # the hook's own test (_should_compress): compress only when the factors are small enough
            if (n + m) * r * state.min_compression_rate < n * m:
                values += (n + m) * r  # P [n, r] and Q [m, r]
            else:
                values += n * m
        return values, "powersgd"
    raise ValueError(
        f"`hook` must be powerSGD_hook or allreduce_hook (the hooks whose traffic is counted), got {hook!r}."
    )


class GradCommCounter:
    """The state of :func:`counting_hook`: the wrapped hook, its state, and this rank's running counts.

    Args:
        hook: the comm hook whose traffic is counted (``powerSGD_hook`` or ``allreduce_hook``).
        state: its state (``PowerSGDState`` for PowerSGD, ``None`` or a process group for all-reduce).

    Attributes:
        bytes_total: all-reduce payload this rank has contributed so far (bytes).
        calls: hook calls so far (one per bucket per synchronised backward).
        by_path: bytes per path (``"allreduce"``, ``"warmup"``, ``"powersgd"``).
    """

    def __init__(self, hook: Callable, state: Any = None) -> None:
        if hook not in (powerSGD_hook, default_hooks.allreduce_hook):
            raise ValueError(
                f"`hook` must be powerSGD_hook or allreduce_hook (the hooks whose traffic is counted), got {hook!r}."
            )
        self.hook = hook
        self.state = state
        self.bytes_total = 0
        self.calls = 0
        self.by_path: dict[str, int] = {}

    @property
    def hook_name(self) -> str:
        return self.hook.__name__

    def count(self, bucket: Any) -> int:
        values, path = bucket_comm_values(self.hook, self.state, bucket)
        nbytes = values * bucket.buffer().element_size()
        self.bytes_total += nbytes
        self.calls += 1
        self.by_path[path] = self.by_path.get(path, 0) + nbytes
        return nbytes


def counting_hook(counter: GradCommCounter, bucket: Any) -> torch.futures.Future:
    """DDP comm hook: count the bucket's traffic, then run the wrapped hook unchanged."""
    counter.count(bucket)
    return counter.hook(counter.state, bucket)


# DDP checks a hook's annotations against the real types; postponed (string) annotations would fail that check.
counting_hook.__annotations__.update(
    bucket=dist.GradBucket, counter=GradCommCounter, **{"return": torch.futures.Future[torch.Tensor]}
)


class PowerSGDStrategy(DDPStrategy):
    """DDP whose gradients are PowerSGD-compressed, with the gradient traffic counted per rank.

    ``strategy: {class_path: lens_callbacks.callbacks.PowerSGDStrategy, init_args: {matrix_approximation_rank: 2,
    start_powerSGD_iter: 2}}`` in a LightningCLI config; on CPU the process group is gloo. The counter is
    :attr:`grad_comm_counter`; ``ArmsRecorder`` reads it.

    Args:
        matrix_approximation_rank: PowerSGD's rank ``r`` (the spec's 77 at scale; 1–4 on a toy model).
        start_powerSGD_iter: backward passes of vanilla all-reduce before compression starts (≥ 2 with error
            feedback or warm start, torch's rule).
        min_compression_rate: compress a tensor only when ``(n + m)·r·rate < n·m``.
        use_error_feedback, warm_start: PowerSGD's options (torch's defaults).
        random_seed: seed of PowerSGD's initial ``Q`` (its own generator; the global RNG is not touched).
        compress: ``False`` runs plain all-reduce through the same counter (the uncompressed base, counted).
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (e.g. ``find_unused_parameters``).
    """

    def __init__(
        self,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 2,
        min_compression_rate: float = 2.0,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        random_seed: int = 0,
        compress: bool = True,
        process_group_backend: Optional[str] = None,
        find_unused_parameters: bool = False,
        **kwargs: Any,
    ) -> None:
        for name, v in (
            ("matrix_approximation_rank", matrix_approximation_rank),
            ("start_powerSGD_iter", start_powerSGD_iter),
        ):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"`{name}` must be an int ≥ 1, got {v!r}.")
        if (use_error_feedback or warm_start) and start_powerSGD_iter < 2:
            raise ValueError(
                f"`start_powerSGD_iter` must be ≥ 2 when use_error_feedback or warm_start is on (torch's rule), "
                f"got {start_powerSGD_iter!r}; set it to 2 or turn both off."
            )
        if (
            not isinstance(min_compression_rate, (int, float))
            or isinstance(min_compression_rate, bool)
            or not min_compression_rate > 0
        ):
            raise ValueError(f"`min_compression_rate` must be a number > 0, got {min_compression_rate!r}.")
        # LightningCLI passes DDPStrategy's own defaults (None) for these: only a value of the user's is refused
        taken = {k: kwargs.pop(k, None) for k in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper")}
        taken = {k: v for k, v in taken.items() if v is not None}
        if taken:
            k, v = next(iter(taken.items()))
            raise ValueError(
                f"`{k}` is set by PowerSGDStrategy (its counted PowerSGD or all-reduce hook), got {v!r}; "
                "use lightning's DDPStrategy for another hook (its traffic is then not counted)."
            )
        if compress:
            # process_group=None: the default group, created by the strategy before the hook first runs
            state: Any = PowerSGDState(
                process_group=None,
                matrix_approximation_rank=matrix_approximation_rank,
                start_powerSGD_iter=start_powerSGD_iter,
                min_compression_rate=min_compression_rate,
                use_error_feedback=use_error_feedback,
                warm_start=warm_start,
                random_seed=random_seed,
            )
            counter = GradCommCounter(powerSGD_hook, state)
        else:
            counter = GradCommCounter(default_hooks.allreduce_hook, None)
        self.grad_comm_counter = counter
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.compress = compress
        super().__init__(
            ddp_comm_state=counter,
            ddp_comm_hook=counting_hook,
            process_group_backend=process_group_backend,
            find_unused_parameters=find_unused_parameters,
            **kwargs,
        )

    def _setup_model(self, model: Any) -> Any:
        if self.compress and self.root_device.type == "cpu":
            # PowerSGD's callbacks run on gloo's worker threads (two by default) and block there on the next
            # all-reduce: with several buckets in flight every worker can end up waiting on work that no free
            # worker is left to run. One bucket on CPU unless the user sized them.
            self._ddp_kwargs.setdefault("bucket_cap_mb", 1 << 20)
        return super()._setup_model(model)

    def _register_ddp_hooks(self) -> None:
        # Lightning registers comm hooks on CUDA only; DDP runs them on CPU (gloo) too, and the base must be
        # the same on every device or the arms would compare runs on different gradients.
        self.model.register_comm_hook(self._ddp_comm_state, self._ddp_comm_hook)

    def grad_comm_info(self) -> dict[str, Any]:
        """What the recorder writes about this base: hook, rank, warm-up, counts of this rank so far."""
        c = self.grad_comm_counter
        return {
            "hook": c.hook_name,
            "matrix_approximation_rank": self.matrix_approximation_rank if self.compress else None,
            "start_powerSGD_iter": self.start_powerSGD_iter if self.compress else None,
            "calls": c.calls,
            "by_path": dict(c.by_path),
            "backend": dist.get_backend() if dist.is_available() and dist.is_initialized() else None,
        }
