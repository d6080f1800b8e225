"""The credit table a person reads: the parts that carried the step, and what each part is.

:func:`credit_table` turns a :class:`~lens_callbacks.credit.report.CreditReport` (and, when known, the
:class:`~lens_callbacks.credit.inputs.terms.CreditTerms` and :class:`~lens_callbacks.credit.inputs.partition.Partition`
it was made from) into a :class:`CreditTable`: the parts sorted by ``|projected share|``, the ``top_k``
largest and the ``bottom_k`` smallest shown, the rest summarised in one line whose share is the sum of
the omitted shares. Beside each part's shares: the group, reward, advantage and trained length of its
rows, and the start of its completion when text is at hand (``CreditTerms.text``, or a ``decode``
callable such as a tokenizer's, see :func:`module_decoder`).

:func:`part_context` makes those per-part columns alone, for readings that split a step some other
way and want the same columns. Both are pure functions of their inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from ..inputs.partition import Partition
from ..inputs.terms import CreditTerms

if TYPE_CHECKING:  # annotations only: the report renders itself through this module, never the reverse
    from ..report import CreditReport

__all__ = ["PartContext", "TableRow", "CreditTable", "credit_table", "part_context", "module_decoder"]

TEXT_WIDTH = 24  # characters of a completion shown in the table


@dataclass(frozen=True)
class PartContext:
    """What a part is, read from the terms: the rows it touches and their labels.

    Attributes:
        rows: number of batch rows with a position in the part.
        group: the group id when all those rows share one, else ``None`` (see ``n_groups``).
        n_groups: number of distinct groups among those rows.
        reward: mean outcome reward of those rows (``None`` without ``CreditTerms.rewards``).
        advantage: mean advantage of those rows (``None`` without ``CreditTerms.advantages``).
        trained: trained positions in the part.
        text: the start of the completion, for a part of one row when text is at hand.
    """

    rows: int
    group: Optional[int]
    n_groups: int
    reward: Optional[float]
    advantage: Optional[float]
    trained: int
    text: Optional[str] = None


@dataclass(frozen=True)
class TableRow:
    """One part of the table: its shares from the report and, when known, its context."""

    part: str
    projected_share: float
    norm_share: float
    part_norm: float
    context: Optional[PartContext] = None


@dataclass(frozen=True)
class CreditTable:
    """A credit report's parts sorted by ``|projected share|``, top and bottom shown, the rest summarised.

    Attributes:
        report: the reading the table shows.
        rows: every part, largest ``|projected share|`` first (batch order when the shares are undefined).
        top_k, bottom_k: how many parts are shown from each end.
        note: why the context columns are absent, when they are.
    """

    report: CreditReport
    rows: tuple[TableRow, ...]
    top_k: int
    bottom_k: int
    note: Optional[str] = None

    @property
    def has_context(self) -> bool:
        return any(r.context is not None for r in self.rows)

    @property
    def has_text(self) -> bool:
        return any(r.context is not None and r.context.text is not None for r in self.rows)

    def split(self) -> tuple[tuple[TableRow, ...], tuple[TableRow, ...], tuple[TableRow, ...]]:
        """``(top, omitted, bottom)``: the parts shown first, the ones summarised, the ones shown last."""
        n = len(self.rows)
        if n <= self.top_k + self.bottom_k:
            return self.rows, (), ()
        return self.rows[: self.top_k], self.rows[self.top_k : n - self.bottom_k], self.rows[n - self.bottom_k :]

    def omitted_summary(self) -> dict[str, float]:
        """The omitted parts in sums: how many, their projected and norm shares, share range, trained positions."""
        _, rest, _ = self.split()
        out = {
            "parts": float(len(rest)),
            "projected_share": math.fsum(r.projected_share for r in rest),
            "norm_share": math.fsum(r.norm_share for r in rest),
        }
        if rest:
            out["min_share"] = min(r.projected_share for r in rest)
            out["max_share"] = max(r.projected_share for r in rest)
        if rest and all(r.context is not None for r in rest):
            out["trained"] = float(sum(r.context.trained for r in rest))  # type: ignore[union-attr]
        return out

    def to_dict(self, prefix: str = "credit/table/") -> dict[str, float]:
        """Flat scalars: parts shown and omitted, the omitted parts' share, the largest ``|share|``."""
        top, rest, bottom = self.split()
        s = self.omitted_summary()
        out = {
            f"{prefix}shown_parts": float(len(top) + len(bottom)),
            f"{prefix}omitted_parts": float(len(rest)),
            f"{prefix}omitted_share": s["projected_share"],
        }
        if self.rows:
            out[f"{prefix}top1_abs_share"] = abs(self.rows[0].projected_share)
        return out

    def render(self) -> str:
        """The table: header, the shown parts, one line for the rest, then the report's closing checks."""
        rep = self.report
        top, rest, bottom = self.split()
        shown = top + bottom
        order = "sorted by |projected share|"
        head_line = f"credit by {rep.partition or 'partition'} ({rep.n_parts} parts, {rep.n_trained} trained positions, {rep.dtype})"
        if rep.ok and rest:
            head_line += f"; {order}, top {len(top)} and bottom {len(bottom)} shown"
        elif rep.ok and len(shown) > 1:
            head_line += f"; {order}"
        lines = [head_line]
        if not rep.ok:
            # Every share is NaN: rows of NaN say nothing the reason does not.
            lines.append(f"UNDEFINED: {rep.reason}")
            return "\n".join(lines + _closing_lines(rep))
        w = max([len("part")] + [len(r.part) for r in shown])
        ctx = self.has_context
        head = f"{'part':<{w}}  {'projected_share':>15}  {'norm_share':>10}  {'||g_S||':>10}"
        if ctx:
            head += f"  {'group':>6}  {'reward':>7}  {'advantage':>9}  {'trained':>7}"
        if self.has_text:
            head += "  completion"
        lines += [head, "-" * len(head)]
        for r in top:
            lines.append(self._row_line(r, w, ctx))
        if rest:
            s = self.omitted_summary()
            line = (
                f"... {len(rest)} more parts: share {s['projected_share']:.6f} in all "
                f"(each {s['min_share']:.6f} .. {s['max_share']:.6f}), norm_share {s['norm_share']:.6f}"
            )
            if "trained" in s:
                line += f", {int(s['trained'])} trained positions"
            lines.append(line)
        for r in bottom:
            lines.append(self._row_line(r, w, ctx))
        lines.append("-" * len(head))
        lines.append(f"{'sum':<{w}}  {rep.share_sum:>15.6f}")
        if self.note:
            lines.append(self.note)
        lines += _closing_lines(rep)
        return "\n".join(lines)

    def _row_line(self, r: TableRow, w: int, ctx: bool) -> str:
        line = f"{r.part:<{w}}  {r.projected_share:>15.6f}  {r.norm_share:>10.6f}  {r.part_norm:>10.3e}"
        if ctx:
            c = r.context
            if c is None:
                line += f"  {'':>6}  {'':>7}  {'':>9}  {'':>7}"
            else:
                group = str(c.group) if c.group is not None else f"{c.n_groups}g"
                line += f"  {group:>6}  {_num(c.reward, 7, '')}  {_num(c.advantage, 9, '+')}  {c.trained:>7d}"
                if c.text is not None:
                    line += f"  {c.text}"
        return line.rstrip()


def _num(v: Optional[float], width: int, sign: str) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{sign}{width}.3f}"


def _closing_lines(rep: CreditReport) -> list[str]:
    lines = [f"cancellation {rep.cancellation:.4f} ({100 * rep.cancelled_fraction:.1f}% of per-part mass cancels)"]
    if rep.ok:
        source = "the trainer's .grad" if rep.engine.endswith(("+training_step", "+grad")) else "its own backward"
        lines.append(f"conservation_error {rep.conservation_error:.3e} ({rep.dtype}; g_full by {source})")
    else:  # relative to a zero or non-finite ||g_full||: undefined, as the logged scalar says
        lines.append(
            f"conservation_error nan (||Σ g_S − g_full|| = {rep.conservation_error:.3e}, relative to ||g_full|| = {rep.full_grad_norm:.3e})"
        )
    if rep.grad_match is not None:
        lines.append(f"grad_match {rep.grad_match:.3e} (g_full vs the trainer's .grad)")
    lines.append(rep._engine_line())
    lines += _position_lines(rep)
    return lines


def _position_lines(rep: CreditReport) -> list[str]:
    """The position split beside the loss-mask split: where the gradient was computed, by segment."""
    split = rep.position_split
    if split is None:
        return []
    if not split.ok:
        return [f"position split: not read ({split.reason})"]
    w = max([len("position part")] + [len(n) for n in split.part_names])
    lines = ["position split (the gradient computed at each segment's positions, trained or not):"]
    lines += [f"  {n:<{w}}  {v:>10.6f}" for n, v in zip(split.part_names, split.projected_share)]
    lines.append(
        f"  {'sum':<{w}}  {math.fsum(split.projected_share):>10.6f}  (conservation_error "
        f"{split.conservation_error:.3e})"
    )
    return lines


def _short(text: str, width: int) -> str:
    """One line of at most ``width`` characters, quoted, with line breaks and tabs made visible."""
    flat = text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
    if len(flat) > width:
        flat = flat[: width - 1] + "…"
    return f'"{flat}"'


def module_decoder(module: Any) -> Optional[Callable[[list[int]], str]]:
    """The module's way from token ids to text, or None.

    A module's ``decode_completion(ids) -> str`` when it has one; else its ``tokenizer.decode`` (Hugging
    Face style; special tokens skipped). Nothing else is looked up.
    """
    hook = getattr(module, "decode_completion", None)
    if callable(hook):
        return hook
    tok = getattr(module, "tokenizer", None)
    decode = getattr(tok, "decode", None)
    if not callable(decode):
        return None

    def _decode(ids: list[int]) -> str:
        try:
            return decode(ids, skip_special_tokens=True)
        except TypeError:  # a decode without that keyword
            return decode(ids)

    return _decode


def part_context(
    terms: CreditTerms,
    partition: Partition,
    text: Optional[Sequence[str]] = None,
    decode: Optional[Callable[[list[int]], str]] = None,
    text_width: int = TEXT_WIDTH,
) -> list[PartContext]:
    """One :class:`PartContext` per part of ``partition``: the group, reward, advantage and trained length
    of the rows it touches, and the start of the completion of a one-row part.

    Text comes from ``text`` (``[B]`` strings), else ``terms.text``, else ``decode`` applied to the token
    ids (``terms.tokens``) at the row's trained positions; without any of them there is no text.

    Raises:
        ValueError: ``partition`` does not have the shape of the terms, or ``text`` is not ``B`` strings.
    """
    trained = terms.trained.detach().cpu()  # [B, T]
    ids = partition.ids.detach().cpu()  # [B, T]
    B = trained.shape[0]
    if tuple(ids.shape) != tuple(trained.shape):
        raise ValueError(
            f"`partition.ids` must have the shape of `terms.trained` {list(trained.shape)}, got {list(ids.shape)}; "
            "pass the partition made from these terms."
        )
    if text is None:
        text = getattr(terms, "text", None)
    if text is not None:
        if isinstance(text, str) or len(text) != B or not all(isinstance(s, str) for s in text):
            raise ValueError(
                f"`text` must be a sequence of {B} strings (one completion per row), got {_describe(text)}; "
                "pass one string per row or none."
            )
    group = terms.group.detach().cpu()  # [B]
    reward = _row_floats(getattr(terms, "rewards", None))  # [B] or None
    adv = _row_floats(getattr(terms, "advantages", None))  # [B] or None
    tokens = terms.tokens.detach().cpu() if getattr(terms, "tokens", None) is not None else None  # [B, T]
    m = len(partition.names)
    out: list[PartContext] = []
    for j in range(m):
        in_part = ids == j  # [B, T]
        per_row = in_part.sum(dim=1)  # [B]
        rows = per_row.nonzero().flatten().tolist()
        groups = sorted({int(group[k]) for k in rows})
        snippet: Optional[str] = None
        if len(rows) == 1:
            k = rows[0]
            if text is not None:
                snippet = _short(text[k], text_width)
            elif decode is not None and tokens is not None:
                snippet = _short(str(decode(tokens[k][trained[k]].tolist())), text_width)
        out.append(
            PartContext(
                rows=len(rows),
                group=groups[0] if len(groups) == 1 else None,
                n_groups=len(groups),
                reward=_mean_at(reward, rows),
                advantage=_mean_at(adv, rows),
                trained=int(per_row.sum()),
                text=snippet,
            )
        )
    return out


def credit_table(
    report: CreditReport,
    terms: Optional[CreditTerms] = None,
    partition: Optional[Partition] = None,
    *,
    text: Optional[Sequence[str]] = None,
    decode: Optional[Callable[[list[int]], str]] = None,
    top_k: int = 5,
    bottom_k: int = 5,
    text_width: int = TEXT_WIDTH,
) -> CreditTable:
    """The credit table of ``report``: parts by ``|projected share|``, ``top_k`` and ``bottom_k`` shown.

    With ``terms`` and the ``partition`` the report was made with, each part gets its context columns
    (:func:`part_context`); without them, or when the partition's part names are not the report's (a
    global reading names parts ``r{rank}/...``), the table has the share columns only and says why.

    Example:
        >>> from lens_callbacks.credit.report import CreditReport
        >>> r = CreditReport(("a", "b", "c"), (0.7, -0.1, 0.4), (0.5, 0.1, 0.4), (5.0, 1.0, 4.0), 1.0, 0.0,
        ...                  None, "float64", 3, 1.0, 0.0, "by_rollout")
        >>> t = credit_table(r, top_k=1, bottom_k=1)
        >>> [row.part for row in t.rows], t.omitted_summary()["projected_share"]
        (['a', 'c', 'b'], 0.4)
    """
    for name, v in (("top_k", top_k), ("bottom_k", bottom_k), ("text_width", text_width)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (2 if name == "text_width" else 0):
            raise ValueError(f"`{name}` must be an int >= {2 if name == 'text_width' else 0}, got {v!r}.")
    contexts: Optional[list[PartContext]] = None
    note: Optional[str] = None
    if terms is not None and partition is not None:
        if tuple(partition.names) == tuple(report.part_names):
            contexts = part_context(terms, partition, text=text, decode=decode, text_width=text_width)
        else:
            note = "group, reward, advantage, trained: not shown (the partition's parts are not the report's)"
    rows = [
        TableRow(
            part=name,
            projected_share=float(report.projected_share[i]),
            norm_share=float(report.norm_share[i]),
            part_norm=float(report.part_norm[i]),
            context=contexts[i] if contexts is not None else None,
        )
        for i, name in enumerate(report.part_names)
    ]
    if report.ok:
        # Stable: equal |shares| (e.g. the zero rows of all-equal groups) keep their batch order.
        rows.sort(key=lambda r: -abs(r.projected_share) if math.isfinite(r.projected_share) else math.inf)
    return CreditTable(report=report, rows=tuple(rows), top_k=top_k, bottom_k=bottom_k, note=note)


def _row_floats(v: Optional[torch.Tensor]) -> Optional[list[float]]:
    if v is None:
        return None
    return [float(x) for x in v.detach().cpu().double().reshape(-1).tolist()]


def _mean_at(values: Optional[list[float]], rows: list[int]) -> Optional[float]:
    if values is None or not rows:
        return None
    return math.fsum(values[k] for k in rows) / len(rows)


def _describe(v: Any) -> str:
    if isinstance(v, str):
        return f"a str {v[:40]!r}"
    try:
        return f"{type(v).__name__} of length {len(v)}"
    except TypeError:
        return repr(v)[:80]
