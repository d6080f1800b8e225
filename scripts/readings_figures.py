"""Regenerate the figures of docs/readings.md from a fresh run of the demo.

    python scripts/readings_figures.py            # trains cli_configs/grpo_credit.yaml, writes docs/figures/*.png
    python scripts/readings_figures.py --run-dir runs/grpo_credit/version_3   # reuse a finished run

Every number in the figures is read back from the run's TensorBoard event files, as a user would see
them; nothing is recomputed here.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "figures"


def run_demo(save_dir: Path, max_steps: int | None) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "lens_callbacks",
        "fit",
        "--config",
        str(ROOT / "cli_configs" / "grpo_credit.yaml"),
        f"--trainer.logger.init_args.save_dir={save_dir}",
        "--trainer.enable_progress_bar=false",
    ]
    if max_steps is not None:
        cmd.append(f"--trainer.max_steps={max_steps}")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("OMP_NUM_THREADS", "1")
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return max((save_dir / "grpo_credit").glob("version_*"), key=lambda p: p.stat().st_mtime)


def load(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def series(acc, tag):
    if tag not in acc.Tags()["scalars"]:
        return [], []
    ev = acc.Scalars(tag)
    return [e.step for e in ev], [e.value for e in ev]


def smooth(ys, beta=0.9):
    out, m, n = [], 0.0, 0
    for y in ys:
        if y == y:  # skip NaN (undefined steps)
            m, n = beta * m + (1 - beta) * y, n + 1
        out.append(m / (1 - beta**n) if n else float("nan"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", type=Path, help="a finished run of the demo config (default: train one now)")
    ap.add_argument("--max-steps", type=int, default=None, help="override the config's max_steps")
    ap.add_argument("--out", type=Path, default=OUT, help=f"where the PNG files go (default {OUT})")
    args = ap.parse_args()
    out = args.out
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run_dir or run_demo(Path(tmp), args.max_steps)
        acc = load(run_dir)
        out.mkdir(parents=True, exist_ok=True)

        # 1. concentration
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.2))
        for tag, label in (
            ("effective_parts_norm", "effective parts (norms)"),
            ("effective_parts_positive", "effective parts (positive shares)"),
        ):
            s, y = series(acc, f"credit/concentration/{tag}")
            a1.plot(s, y, lw=0.6, alpha=0.4)
            a1.plot(s, smooth(y), lw=1.6, label=label, color=a1.lines[-1].get_color())
        s, y = series(acc, "credit/n_parts")
        a1.plot(s, y, "k:", lw=0.8, label="rollouts in the batch")
        a1.set_xlabel("step")
        a1.set_ylabel("parts")
        a1.legend(fontsize=7)
        a1.set_title("does one rollout carry the step?")
        for tag, label in (
            ("top1_share", "top-1 share"),
            ("topk_share", "top-3 share"),
            ("negative_mass", "share taken back by negative parts"),
        ):
            s, y = series(acc, f"credit/concentration/{tag}")
            a2.plot(s, smooth(y), lw=1.4, label=label)
        a2.set_xlabel("step")
        a2.legend(fontsize=7)
        a2.set_title("smoothed (EMA 0.9)")
        fig.tight_layout()
        fig.savefig(out / "concentration.png", dpi=110)
        plt.close(fig)

        # 2. advantage split
        fig, ax = plt.subplots(figsize=(7, 3.2))
        for name in ("positive", "negative"):
            s, y = series(acc, f"credit/by_advantage_sign/projected_share/{name}")
            ax.plot(s, y, lw=0.5, alpha=0.35)
            ax.plot(s, smooth(y), lw=1.8, color=ax.lines[-1].get_color(), label=f"{name}-advantage rollouts")
        ax.axhline(0.5, color="k", lw=0.6, ls=":")
        ax.set_xlabel("step")
        ax.set_ylabel("projected share")
        ax.legend(fontsize=7)
        ax.set_title("how much of the step rewards good rollouts vs pushes away from bad ones")
        fig.tight_layout()
        fig.savefig(out / "advantage_split.png", dpi=110)
        plt.close(fig)

        # 3. noise scale
        fig, ax = plt.subplots(figsize=(7, 3.2))
        s, y = series(acc, "credit/noise/b_simple")
        ax.plot(s, y, ".", ms=2.5, alpha=0.4, label="per step (noisy ratio)")
        s, y = series(acc, "credit/noise/b_simple_ema")
        ax.plot(s, y, lw=1.8, label="B_simple, ratio of EMAs")
        s, n = series(acc, "credit/n_parts")
        if n:
            ax.axhline(max(n), color="k", ls="--", lw=0.8, label=f"rollouts per step ({int(max(n))})")
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_xlabel("step")
        ax.set_ylabel("rollouts")
        ax.legend(fontsize=7)
        ax.set_title("gradient noise scale against the batch")
        fig.tight_layout()
        fig.savefig(out / "noise_scale.png", dpi=110)
        plt.close(fig)

        # 4. ledger (stacked cumulative shares)
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
        for ax, part in zip(axes, ("by_source", "by_advantage_sign")):
            tags = sorted(t for t in acc.Tags()["scalars"] if t.startswith(f"credit/ledger/gradient/{part}/"))
            got = [series(acc, t) for t in tags]
            if not got:
                continue
            steps = got[0][0]
            ys = [[max(v, 0.0) for v in y] for _, y in got]
            neg = [[min(v, 0.0) for v in y] for _, y in got]
            polys = ax.stackplot(steps, *ys, labels=[t.rsplit("/", 1)[1] for t in tags], alpha=0.85)
            if any(v < 0 for y in neg for v in y):
                ax.stackplot(steps, *neg, colors=[p.get_facecolor() for p in polys], alpha=0.85)
            ax.axhline(0.0, color="k", lw=0.6)
            ax.set_xlabel("step")
            ax.set_ylabel("cumulative share")
            ax.legend(fontsize=7, loc="upper left")
            ax.set_title(f"run ledger, {part}")
        fig.tight_layout()
        fig.savefig(out / "ledger.png", dpi=110)
        plt.close(fig)

        # 5. the Lorenz curve the callback logged last, as TensorBoard shows it
        if "credit/concentration/lorenz" in acc.Tags()["images"]:
            (out / "lorenz.png").write_bytes(acc.Images("credit/concentration/lorenz")[-1].encoded_image_string)
    print(f"wrote {sorted(p.name for p in out.glob('*.png'))} to {out}")


if __name__ == "__main__":
    main()
