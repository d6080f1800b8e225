"""Builders of the second round of hostile inputs, each with a parameter that scales the attack.

Families: long step lists, wide and deep ``init_args``, sparse and growing files, link farms and loops,
broken YAML. Each builder writes real bytes (or links, or sparse files that use no disk) and returns the
path to hand to the command; nothing here reads them back. The tests (``test_fuzz_*.py``) run each through
the real command in a forked child (isolated.py) and check the one-line refusal, its memory and its time.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Optional

import torch

GiB = 1 << 30
MiB = 1 << 20

#: The manifest fields an audit reads, as RunRecordCallback writes them for the tools example.
MANIFEST = {
    "schema": "lens_callbacks.record/1",
    "trajectory_schema": "lens_callbacks.trajectory/1",
    "module": "lens_callbacks.examples.grpo_tools.module.GRPOToolsModule",
    "batch_builder": None,
    "init_args": {
        "dropout": 0.0,
        "dtype": "float32",
        "group_size": 2,
        "lr": 0.05,
        "max_new_tokens": 6,
        "max_tool_calls": 2,
        "momentum": 0.0,
        "n_embd": 32,
        "n_head": 2,
        "n_layer": 2,
        "optimizer": "sgd",
        "padding_side": "right",
        "seed": 0,
        "segment_by": "turn",
        "system_prompt": "tools : calc",
        "temperature": 1.0,
        "warm_start_lr": 0.01,
        "warm_start_steps": 40,
        "weight_decay": 0.0,
    },
    "optimizer": [{"class": "torch.optim.sgd.SGD", "param_groups": [{"lr": 0.05, "momentum": 0.0}]}],
    "trainer": {
        "gradient_clip_val": None,
        "gradient_clip_algorithm": None,
        "accumulate_grad_batches": 1,
        "precision": "32-true",
        "world_size": 1,
    },
    "steps": [0],
    "checkpoints": [0],
}

LINE = {
    "schema": "lens_callbacks.trajectory/1",
    "step": 0,
    "group": 0,
    "rollout": 0,
    "prompt_id": "1+1",
    "reward": 1.0,
    "turns": [
        {"role": "user", "text": "1 + 1 =", "token_ids": [3, 4, 5], "trained": False, "tool_call": None},
        {"role": "assistant", "text": "2", "token_ids": [6], "trained": True, "tool_call": None},
    ],
}


def write_record(d: Path, manifest: Optional[dict] = None, lines_by_step: Optional[dict] = None) -> Path:
    """A run record folder without any training: its manifest and the trajectory files given (no checkpoint)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "record.json").write_text(json.dumps(manifest or MANIFEST))
    (d / "trajectories").mkdir(exist_ok=True)
    for step, lines in (lines_by_step or {}).items():
        (d / "trajectories" / f"step_{step:06d}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return d


def traj_line(step: int = 0, group: int = 0, rollout: int = 0, **over: Any) -> dict:
    d = json.loads(json.dumps(LINE))
    d.update(step=step, group=group, rollout=rollout, **over)
    return d


# --------------------------------------------------------------------------------------------- long step lists
def long_step_list(d: Path, n: int, shape: str = "range") -> Path:
    """``record.json`` listing ``n`` steps (690 KB at 100,000) with only step 0's trajectory file present."""
    if shape == "range":
        steps = list(range(n))
    elif shape == "reversed":
        steps = list(range(n - 1, -1, -1))
    elif shape == "strided":
        steps = list(range(0, 7 * n, 7))
    else:  # "huge": step numbers near the largest accepted
        steps = [10**12 - n + i for i in range(n)]
    m = dict(MANIFEST, steps=steps, checkpoints=[0] if shape != "huge" else [steps[0]])
    lines = {0: [traj_line()]} if shape != "huge" else {}
    return write_record(d, m, lines)


# --------------------------------------------------------------------------------------------- init args
def edit_init_args(rec: Path, kind: str, n: int) -> Path:
    """Change the real record's ``init_args`` (or ``module``): ``kind`` names the attack, ``n`` its size."""
    p = rec / "record.json"
    m = json.loads(p.read_text())
    ia = m["init_args"]
    if kind == "wide":  # n unknown keys
        ia.update({f"k{i:07d}": i for i in range(n)})
    elif kind == "deep":  # one argument nested n lists deep (json refuses beyond its recursion limit)
        text = json.dumps(m).replace('"system_prompt": "tools : calc"', '"system_prompt": ' + "[" * n + "]" * n)
        p.write_text(text)
        return p
    elif kind in ("n_embd", "n_layer", "n_head"):
        ia[kind] = n
    elif kind == "module_string":  # a long import path
        m["module"] = "a." * (n // 2) + "B"
    elif kind == "builder_string":
        m["batch_builder"] = "a." * (n // 2) + "f"
    elif kind == "long_key":
        ia["k" * n] = 1
    else:
        raise ValueError(kind)
    p.write_text(json.dumps(m))
    return p


# --------------------------------------------------------------------------------------------- sparse and growing files
def sparse(path: Path, size: int, head: bytes = b"") -> Path:
    """A file of ``size`` bytes that uses no disk beyond ``head`` (the rest reads as zeros)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    return path


class Grower:
    """Grows a file in the background (sparsely, ``step`` bytes at a time) until stopped."""

    def __init__(self, path: Path, step: int = 8 * MiB, limit: int = 3 * GiB) -> None:
        self.path, self.step, self.limit = path, step, limit
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with open(self.path, "ab") as f:
            while not self._stop.is_set():
                size = os.fstat(f.fileno()).st_size
                if size + self.step > self.limit:
                    break
                f.write(json.dumps(traj_line()).encode() + b"\n")
                f.flush()
                f.truncate(size + self.step)
                f.seek(0, os.SEEK_END)

    def __enter__(self) -> "Grower":
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()


# --------------------------------------------------------------------------------------------- links
def checkpoint_farm(d: Path, n_links: int, numel: int = 1 << 18, named_steps: bool = True) -> Path:
    """One plain state-dict checkpoint and ``n_links`` links to it named as other steps (or as ``last``)."""
    d.mkdir(parents=True, exist_ok=True)
    torch.save({"layer.weight": torch.zeros(numel)}, d / "step_0.pt")
    for i in range(1, n_links + 1):
        os.symlink("step_0.pt", d / (f"step_{10 * i}.pt" if named_steps else f"last_{i}.pt"))
    return d


def link_loops(d: Path, breadth: int, depth: int = 1, with_root_link: bool = True) -> Path:
    """A folder whose sub-folders link back to their parents ``breadth`` times, ``depth`` real levels deep."""
    cur = d
    cur.mkdir(parents=True, exist_ok=True)
    for level in range(depth):
        for b in range(breadth):
            os.symlink(".", cur / f"loop{b}")
        if with_root_link and level == 0:
            os.symlink("/", cur / "root")
        cur = cur / f"sub{level}"
        cur.mkdir()
    return d


#: Link targets outside a run folder: the kernel's files, a device, an ordinary file elsewhere.
OUTSIDE = ["/proc/self/pagemap", "/proc/self/mem", "/dev/zero", "/etc/hostname", "/etc/passwd"]


# --------------------------------------------------------------------------------------------- yaml
CONFIG = """\
seed_everything: 0
trainer:
  max_steps: 2
  accelerator: cpu
  logger: false
model:
  class_path: lens_callbacks.examples.grpo_tools.module.GRPOToolsModule
  init_args:
    n_layer: 2
data:
  class_path: lens_callbacks.examples.grpo_tools.module.ToolsAdditionDataModule
"""


def alias_bomb(levels: int, fan: int = 9) -> str:
    """The billion laughs: level k lists level k-1 ``fan`` times; ``fan**levels`` nodes once expanded."""
    out = ["a0: &a0 [lol]"]
    for k in range(1, levels + 1):
        out.append(f"a{k}: &a{k} [" + ", ".join([f"*a{k - 1}"] * fan) + "]")
    return "\n".join(out) + "\n"


def python_tag(marker: Path, kind: str = "apply") -> str:
    if kind == "apply":
        return f"model: !!python/object/apply:pathlib.Path.touch [{str(marker)!r}]\n"
    if kind == "new":
        return f"model: !!python/object/new:pathlib.Path [{str(marker)!r}]\n"
    return "model: !!python/name:os.system\n"


# --------------------------------------------------------------------------------------------- checks shared by the families
LONG = os.environ.get("LENS_FUZZ_LONG", "") not in ("", "0")
PEAK_MB = 600
CASE_S = 10.0


def _stats(family: str, r: Any) -> None:
    """Append the case's numbers to ``$LENS_FUZZ_STATS`` (JSON Lines) when set: the long run's table."""
    out = os.environ.get("LENS_FUZZ_STATS")
    if out:
        with open(out, "a") as f:
            f.write(
                json.dumps(
                    {
                        "family": family,
                        "rc": r.rc,
                        "peak_mb": round(r.peak_mb, 1),
                        "wall_s": round(r.wall_s, 3),
                        "cpu_s": round(getattr(r, "cpu_s", float("nan")), 3),
                    }
                )
                + "\n"
            )


def refused(
    r: Any, family: str, *needles: str, marker: Optional[Path] = None, rcs: tuple = (2,), forbidden: tuple = ()
) -> str:
    """One line on stderr holding every needle, exit status in ``rcs``, within 600 MB and 10 s, no marker file."""
    _stats(family, r)
    lines = r.stderr.splitlines()
    assert not r.timed_out, (family, r.wall_s, r.stderr[-2000:])
    assert r.rc in rcs, (family, r.rc, r.stderr[-3000:], r.stdout[-500:])
    if r.rc == 2:
        assert len(lines) == 1, (family, r.stderr[-3000:])
        for n in needles:
            assert n in lines[0], (family, n, lines[0])
        for n in forbidden:
            assert n not in lines[0], (family, n, lines[0])
    assert "Traceback" not in r.stderr and "MemoryError" not in r.stderr, (family, r.stderr[-3000:])
    assert r.peak_mb <= PEAK_MB, (family, r.peak_mb, lines[:1])
    assert r.wall_s <= CASE_S, (family, r.wall_s, lines[:1])
    if marker is not None:
        assert not marker.exists(), f"{family}: code ran ({marker} exists)"
    return lines[0] if lines else ""


def assert_scales(
    family: str, run: Any, params: list, tiny: Any, repeats: int = 2, noise_s: float = 0.6, noise_mb: float = 24.0
) -> list:
    """Doubling the attacker's parameter at most doubles the command's CPU time and memory (above a tiny case's).

    ``run(p)`` runs the command once on the input of parameter ``p`` and returns the worker's result. Each
    reading is the least of ``repeats`` runs (a shared machine only ever adds time); ``noise_s`` and ``noise_mb``
    absorb what the machine adds on top. A check that grows as the square of its input fails by far: 4 x per
    doubling of a part that is already seconds long.
    """

    def measure(p: Any) -> tuple[float, float]:
        rs = [run(p) for _ in range(repeats)]
        for r in rs:
            refused(r, family, rcs=(0, 2, 3))
        return min(r.cpu_s for r in rs), min(r.peak_mb for r in rs)

    t0, m0 = measure(tiny)
    rows = [(p, *measure(p)) for p in params]
    for (p1, t1, m1), (p2, t2, m2) in zip(rows, rows[1:]):
        assert t2 - t0 <= 2.0 * max(t1 - t0, 0.0) + noise_s, (family, "time", p1, p2, t0, t1, t2, rows)
        assert m2 - m0 <= 2.0 * max(m1 - m0, 0.0) + noise_mb, (family, "memory", p1, p2, m0, m1, m2, rows)
    return rows
