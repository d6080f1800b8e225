"""GrowingWeightTrajRing: anchor-visible weight snapshots as a base, fp32 deltas and a float64 Gram.

Per tensor, flattened to ``θ ∈ R^d``: a base ``θ_base`` (the oldest retained snapshot), consecutive
deltas ``d_k = θ_{t_k} − θ_{t_{k−1}}`` (one fp32 difference each: no cancellation against a far base),
and the consecutive-delta Gram ``D[k, l] = <d_k, d_l>`` in float64. The base-delta Gram over
``Δ_i = θ_i − θ_base = Σ_{k≤i} d_k`` is the prefix sum ``B = L D Lᵀ`` (``L`` lower-triangular ones), so
the fit never touches a d-vector. Storage of the Gram is ``W × W`` per tensor, independent of ``d``.

The Gram is additive over coordinates: a rank holding a shard of a tensor computes its shard's Gram
row, and the sum over ranks (``row_reduce``) is the whole tensor's Gram.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Optional, Sequence

import torch

__all__ = ["GrowingWeightTrajRing", "rebase_gram", "prefix_gram"]


def prefix_gram(D: torch.Tensor) -> torch.Tensor:
    r"""Base-delta Gram from the consecutive-delta Gram: ``B = L D Lᵀ`` by two prefix sums.

    ``B[i, j] = <Δ_i, Δ_j>`` with ``Δ_i = Σ_{k≤i} d_k``.

    Example:
        >>> D = torch.tensor([[1.0, 0.0], [0.0, 4.0]], dtype=torch.float64)
        >>> prefix_gram(D).tolist()
        [[1.0, 1.0], [1.0, 5.0]]
    """
    return D.cumsum(0).cumsum(1)  # [n, n]


def rebase_gram(B: torch.Tensor) -> torch.Tensor:
    r"""Re-base a base-delta Gram onto its first snapshot (bilinear), dropping that snapshot.

    With the new base ``θ_1``, ``Δ'_i = Δ_i − Δ_0`` (0 = oldest retained delta), so
    ``B'[i, j] = B[i, j] − B[i, 0] − B[0, j] + B[0, 0]`` for ``i, j ≥ 1``.

    Example:
        >>> B = torch.tensor([[1.0, 1.0], [1.0, 5.0]], dtype=torch.float64)
        >>> rebase_gram(B).tolist()
        [[4.0]]
    """
    Bs = B[1:, 1:] - B[1:, :1] - B[:1, 1:] + B[0, 0]  # [n-1, n-1]
    return 0.5 * (Bs + Bs.T)


class GrowingWeightTrajRing:
    r"""Base snapshot, consecutive fp32 deltas and their float64 Gram, per named tensor.

    ``W`` counts snapshots (the base included); at most ``w_cap`` are retained. Appending past the cap
    does not drop by itself: the caller reads what it needs (the retrospective prediction, ``fire_cos``)
    and then calls :meth:`drop_oldest_and_rebase`.

    Args:
        w_cap: the most snapshots retained (base included), ``≥ 2``.

    Example:
        >>> ring = GrowingWeightTrajRing(w_cap=3)
        >>> for t, x in [(0, 0.0), (10, 1.0), (20, 3.0)]:
        ...     ring.append({"w": torch.tensor([x, 0.0])}, t)
        >>> ring.W, ring.ticks, ring.base_gram().tolist()
        (3, [0, 10, 20], [[1.0, 3.0], [3.0, 9.0]])
    """

    def __init__(self, w_cap: int = 16) -> None:
        if not isinstance(w_cap, int) or isinstance(w_cap, bool) or w_cap < 2:
            raise ValueError(f"`w_cap` must be an int ≥ 2, got {w_cap!r}.")
        self.w_cap = w_cap
        self.names: list[str] = []
        self.ticks: list[int] = []
        self.base: dict[str, torch.Tensor] = {}  # θ_base, fp32, flat
        self.prev: dict[str, torch.Tensor] = {}  # θ of the newest snapshot, fp32, flat
        self.deltas: list[dict[str, torch.Tensor]] = []  # d_k, fp32, flat
        self.D: dict[str, torch.Tensor] = {}  # [n, n] float64 per tensor, n = W − 1
        self.first_delta_id = 0  # global id of deltas[0] (ids survive drops)

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def W(self) -> int:
        """Snapshots retained, base included."""
        return len(self.ticks)

    @property
    def n_deltas(self) -> int:
        return len(self.deltas)

    @property
    def over_cap(self) -> bool:
        return self.W > self.w_cap

    def numel(self, names: Optional[Iterable[str]] = None) -> int:
        return sum(self.base[n].numel() for n in (self.names if names is None else names))

    def delta_ids(self) -> list[int]:
        return list(range(self.first_delta_id, self.first_delta_id + self.n_deltas))

    # -- updates -------------------------------------------------------------------------------
    def append(
        self,
        snapshot: Mapping[str, torch.Tensor],
        tick: int,
        row_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ) -> None:
        """Fold in a new anchor-visible snapshot taken at ``tick``.

        ``d_new = θ_new − θ_prev`` (fp32), ``D[k, new] = <d_k, d_new>``, ``D[new, new] = ||d_new||²``.
        ``row_reduce`` sums a float64 Gram row over shards (e.g. an all-reduce); the identity otherwise.
        """
        tick = int(tick)
        if self.ticks and tick <= self.ticks[-1]:
            raise ValueError(f"`tick` must increase, got {tick} after {self.ticks[-1]}.")
        if not self.ticks:
            self.names = list(snapshot)
            for n in self.names:
                x = snapshot[n].detach().reshape(-1).to(torch.float32).clone()  # [d]
                self.base[n] = x
                self.prev[n] = x.clone()
                self.D[n] = torch.zeros(0, 0, dtype=torch.float64)
            self.ticks.append(tick)
            return
        missing = sorted(set(self.names) - set(snapshot))
        if missing:
            raise ValueError(f"`snapshot` must hold every tensor of the ring, missing {missing[:5]!r}.")
        new: dict[str, torch.Tensor] = {}
        for n in self.names:
            x = snapshot[n].detach().reshape(-1).to(torch.float32)  # [d]
            d_new = x - self.prev[n]  # [d] one fp32 diff
            d64 = d_new.double()
            row = torch.empty(self.n_deltas + 1, dtype=torch.float64)  # [n+1]
            for k, dk in enumerate(self.deltas):
                row[k] = torch.dot(dk[n].double(), d64).cpu()
            row[-1] = torch.dot(d64, d64).cpu()
            if row_reduce is not None:
                row = row_reduce(row)
            old = self.D.get(n, torch.zeros(0, 0, dtype=torch.float64))
            m = old.shape[0]
            Dn = torch.zeros(m + 1, m + 1, dtype=torch.float64)
            Dn[:m, :m] = old
            Dn[m, :] = row
            Dn[:, m] = row
            self.D[n] = Dn
            new[n] = d_new
            self.prev[n] = x.clone()
        self.deltas.append(new)
        self.ticks.append(tick)

    def drop_oldest_and_rebase(self) -> None:
        """Drop the oldest snapshot: the base moves to the next one, ``B`` re-bases bilinearly.

        With consecutive deltas stored, the re-based ``B' = rebase_gram(B)`` is the prefix sum of ``D``
        without its first row and column; ``θ_base`` is updated in place (``θ_base += d_0``).
        """
        if self.n_deltas == 0:
            raise ValueError("cannot drop from a ring holding a single snapshot.")
        d0 = self.deltas.pop(0)
        for n in self.names:
            self.base[n].add_(d0[n])
            self.D[n] = self.D[n][1:, 1:].clone()
        self.ticks.pop(0)
        self.first_delta_id += 1

    # -- reads ---------------------------------------------------------------------------------
    def consecutive_gram(self, names: Optional[Sequence[str]] = None) -> torch.Tensor:
        """``D`` summed over ``names`` (all tensors by default): the pooled Gram of their concatenation."""
        names = self.names if names is None else names
        out = torch.zeros(self.n_deltas, self.n_deltas, dtype=torch.float64)
        for n in names:
            out += self.D[n]
        return out

    def base_gram(self, names: Optional[Sequence[str]] = None) -> torch.Tensor:
        """``B = L D Lᵀ`` over the window (``[W−1, W−1]``), pooled over ``names``."""
        return prefix_gram(self.consecutive_gram(names))

    def snapshot(self, i: int, name: str) -> torch.Tensor:
        """Snapshot ``i`` (0 = base) of one tensor, rebuilt from the base and the deltas (fp32, flat)."""
        x = self.base[name].clone()
        for k in range(i):
            x += self.deltas[k][name]
        return x

    def displacements(self, name: str) -> Iterable[torch.Tensor]:
        """Stream ``Δ_1 … Δ_{W−1}`` of one tensor as float64 prefix sums of the stored deltas (one buffer, reused)."""
        acc = torch.zeros_like(self.base[name], dtype=torch.float64)
        for dk in self.deltas:
            acc.add_(dk[name])  # in place: each Δ_i is valid until the next one is drawn
            yield acc

    # -- persistence ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "w_cap": self.w_cap,
            "names": list(self.names),
            "ticks": list(self.ticks),
            "base": {n: t.clone() for n, t in self.base.items()},
            "prev": {n: t.clone() for n, t in self.prev.items()},
            "deltas": [{n: t.clone() for n, t in d.items()} for d in self.deltas],
            "D": {n: t.clone() for n, t in self.D.items()},
            "first_delta_id": self.first_delta_id,
        }

    def load_state_dict(self, state: Mapping) -> None:
        self.w_cap = int(state["w_cap"])
        self.names = list(state["names"])
        self.ticks = [int(t) for t in state["ticks"]]
        self.base = {n: t.clone() for n, t in state["base"].items()}
        self.prev = {n: t.clone() for n, t in state["prev"].items()}
        self.deltas = [{n: t.clone() for n, t in d.items()} for d in state["deltas"]]
        self.D = {n: t.clone() for n, t in state["D"].items()}
        self.first_delta_id = int(state["first_delta_id"])
