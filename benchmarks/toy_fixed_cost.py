"""The one-pass audit's fixed cost on a toy, against an earlier commit, in the same hour.

A transformers GPT-2 (2 layers, width 128, vocabulary 64, eager attention), ``T = 48`` (8 prompt + 40 trained),
``by_rollout`` with ``readings="all"``, m = 8, 32, 64 rows: a separate one-pass audit (``engine="ghost"``)
over the plain step (forward, backward, Adam), one thread, medians of ``--repeats``. On a step of a few
thousand small kernels, what the audit adds per parameter or per piece shows up here first.

``--against COMMIT`` checks that commit out in a temporary git worktree and runs the same measurement with its
``lens_callbacks``, alternating with this checkout's ``--rounds`` times, so that machine load hits both alike.

Usage: ``python benchmarks/toy_fixed_cost.py [--against eb53c73] [--rounds 3] [--repeats 11]``; written to
``benchmarks/results/toy_fixed_cost-<date>.txt``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(repeats: int) -> dict[int, float]:
    """audit / step at m = 8, 32, 64 with the ``lens_callbacks`` on ``sys.path``."""
    import torch
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    from lens_callbacks.credit import CreditTerms, disintegrate

    torch.set_num_threads(1)

    class Policy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            cfg = GPT2Config(
                vocab_size=64,
                n_positions=64,
                n_embd=128,
                n_layer=2,
                n_head=2,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                bos_token_id=0,
                eos_token_id=0,
            )
            cfg._attn_implementation = "eager"
            self.lm = GPT2LMHeadModel(cfg)

        def credit_terms(self, batch):
            x, adv = batch
            lp = torch.log_softmax(self.lm(input_ids=x).logits[:, :-1], -1).gather(-1, x[:, 1:, None])[..., 0]
            lp = F.pad(lp, (1, 0))
            trained = torch.zeros_like(x, dtype=torch.bool)
            trained[:, 8:] = True
            terms = torch.where(trained, -adv[:, None] * lp / trained.sum(), torch.zeros_like(lp))
            n = x.shape[0]
            return CreditTerms(terms, trained, torch.arange(n), torch.arange(n) // 4)

    out = {}
    for m in (8, 32, 64):
        pol = Policy()
        opt = torch.optim.Adam(pol.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(m)
        batch = (torch.randint(0, 64, (m, 48), generator=g), torch.randn(m, generator=g))

        def step():
            opt.zero_grad()
            pol.credit_terms(batch).terms.sum().backward()
            opt.step()

        def audit():
            disintegrate(pol, batch, "by_rollout", engine="ghost", readings="all")

        step()
        audit()
        plain, audits = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            step()
            plain.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            audit()
            audits.append(time.perf_counter() - t0)
        out[m] = statistics.median(audits) / statistics.median(plain)
    return out


def run_in(root: Path, repeats: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    code = f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import json, toy_fixed_cost as t; print(json.dumps(t.measure({repeats})))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=root)
    if r.returncode != 0:
        raise SystemExit(f"the measurement failed in {root}: {r.stderr[-1500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default=None, help="an earlier commit to measure beside this checkout")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=11)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1:
        ap.error(f"--rounds and --repeats must be at least 1, got {args.rounds} and {args.repeats}")
    roots = {"this checkout": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        if args.against:
            wt = Path(tmp) / "against"
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "-f", "-q", "--detach", str(wt), args.against], check=True
            )
            roots[args.against] = wt
        lines = [f"{'code':14s} {'round':>5s}  audit / step at m = 8, 32, 64"]
        try:
            for k in range(args.rounds):
                for name, root in roots.items():
                    got = run_in(root, args.repeats)
                    lines.append(f"{name:14s} {k + 1:>5d}  " + "  ".join(f"{got[str(m)]:.2f}" for m in (8, 32, 64)))
                    print(lines[-1], flush=True)
        finally:
            if args.against:
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(roots[args.against])], check=False
                )
    out = ROOT / "benchmarks" / "results" / f"toy_fixed_cost-{datetime.date.today().isoformat()}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = " ".join(["python benchmarks/toy_fixed_cost.py"] + (argv if argv is not None else sys.argv[1:]))
    with out.open("a") as fh:
        fh.write(f"{cmd}\n\n" + "\n".join(lines) + "\n\n")
    print(f"appended: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
