"""The arms runner's bookkeeping (resume, crash, re-run on a changed setting) with a stand-in trainer process.

The stand-in is a ``lens_callbacks`` package in the runs' working directory (it comes first on their
``PYTHONPATH``): it reads the run's config, writes the record the real ``ArmsRecorder`` writes, counts its
calls, and fails for an arm whose anchor mode is ``"bogus"``. The real trainer runs in test_anchor_arms_cli.py.
"""

import json
import textwrap

import pytest

from lens_callbacks.anchor.arms import run_arms

FAKE_MAIN = textwrap.dedent("""
    import json, sys, yaml
    argv = sys.argv[1:]
    cfg = yaml.safe_load(open(argv[argv.index("--config") + 1]))
    steps, seed = int(argv[argv.index("--trainer.max_steps") + 1]), int(argv[argv.index("--seed_everything") + 1])
    cbs = cfg["trainer"]["callbacks"]
    anchor = [c for c in cbs if c["class_path"].endswith("AnchorProjectionCallback")]
    rec = [c for c in cbs if c["class_path"].endswith("ArmsRecorder")][0]["init_args"]
    mode = anchor[0]["init_args"]["mode"] if anchor else None
    with open("calls.txt", "a") as f:
        f.write(f"{mode} {seed} {steps}\\n")
    import os
    with open("ports.txt", "a") as f:
        f.write(f"{mode} {seed} {os.environ.get('MASTER_PORT')}\\n")
    if mode in ("clash", "clash_always"):  # torch's TCPStore when another process holds the port
        tries = sum(1 for x in open("ports.txt") if x.startswith(f"{mode} {seed} "))
        if mode == "clash_always" or tries == 1:
            sys.exit("torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
                     "network address. port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address "
                     "already in use")
    if mode == "bogus":
        sys.exit("ValueError: `mode` must be one of ('off', 'signed_ema', 'projected'), got 'bogus'.")
    score = 0.5 + 0.01 * seed + {"projected": 0.05}.get(mode, 0.0)
    fires = [] if mode in (None, "off") else [{"t_fast": 2, "projected": False, "comm_bytes": 100.0,
                                               "gated_on_fraction": 0.0}]
    json.dump({"scores": [[steps, score]], "grad_norms": [[0, 1.0]], "fires": fires, "param_hash": f"{mode in (None, 'off')}{seed}",
               "logged_tags": [rec["score"]], "refusal": None}, open(rec["out"], "w"))
""")


@pytest.fixture
def fake_cwd(tmp_path):
    pkg = tmp_path / "cwd" / "lens_callbacks"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(FAKE_MAIN)
    return tmp_path / "cwd"


def calls(cwd):
    p = cwd / "calls.txt"
    return p.read_text().splitlines() if p.exists() else []


CFG = {
    "trainer": {
        "callbacks": [
            {
                "class_path": "lens_callbacks.callbacks.AnchorProjectionCallback",
                "init_args": {"mode": "projected", "cadence": 2},
            }
        ]
    },
    "model": {"class_path": "M"},
}


def test_resume_crash_and_rerun_on_a_changed_setting(fake_cwd, tmp_path):
    out = tmp_path / "out"
    kw = dict(seeds=2, steps=3, out=out, cwd=fake_cwd, progress=False, jobs=2, arm_defs={"X": {"mode": "bogus"}})
    rep = run_arms(CFG, ["off", "A", "C", "X"], **kw)
    assert sorted(calls(fake_cwd)) == sorted(
        [
            "off 0 3",
            "off 1 3",
            "signed_ema 0 3",
            "signed_ema 1 3",
            "projected 0 3",
            "projected 1 3",
            "bogus 0 3",
            "bogus 1 3",
            "None 0 3",
        ]
    )
    assert rep.verdict == "stop" and rep.arms["C"].delta_mean == pytest.approx(0.05, abs=1e-12)
    crashed = [r for r in rep.runs if r.arm == "X"]
    assert all(r.status == "crashed" and "bogus" in r.error for r in crashed)
    assert json.loads((out / "decision.json").read_text())["verdict"] == "stop"

    # again: every finished run is read back, the crashed ones are run again
    (fake_cwd / "calls.txt").unlink()
    rep2 = run_arms(CFG, ["off", "A", "C", "X"], **kw)
    assert sorted(calls(fake_cwd)) == ["bogus 0 3", "bogus 1 3"]
    assert sorted(rep2.settings["read_back"]) == sorted(
        [f"{a}/seed{s}" for a in ("off", "A", "C") for s in (0, 1)] + ["none/seed0"]
    )

    # a changed setting (steps, or the arm's arguments) is not read back
    (fake_cwd / "calls.txt").unlink()
    run_arms(CFG, ["A", "C"], **{**kw, "steps": 4})
    assert sorted(calls(fake_cwd)) == ["projected 0 4", "projected 1 4", "signed_ema 0 4", "signed_ema 1 4"]
    (fake_cwd / "calls.txt").unlink()
    rep3 = run_arms(CFG, ["A", "C"], **{**kw, "steps": 4, "anchor_args": {"cadence": 3}})
    assert len(calls(fake_cwd)) == 4 and rep3.verdict == "promote"


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="`arms` must be among"):
        run_arms(CFG, ["A", "Z"], out=tmp_path, progress=False)
    with pytest.raises(ValueError, match="must include 'A'"):
        run_arms(CFG, ["off", "C"], out=tmp_path, progress=False)
    with pytest.raises(ValueError, match="`steps` must be"):
        run_arms(CFG, ["A"], steps=0, out=tmp_path, progress=False)
    with pytest.raises(ValueError, match="`seeds` must be"):
        run_arms(CFG, ["A"], seeds=0, out=tmp_path, progress=False)
    with pytest.raises(ValueError, match="`config` must be"):
        run_arms(tmp_path / "missing.yaml", ["A"], out=tmp_path, progress=False)


def test_parallel_runs_get_their_own_port_and_a_port_clash_is_run_again(fake_cwd, tmp_path):
    from lens_callbacks.anchor.arms import _PORT_RANGE, PORT_RETRIES

    rep = run_arms(
        CFG,
        ["A", "C", "X", "Y"],
        seeds=2,
        steps=3,
        out=tmp_path / "out",
        cwd=fake_cwd,
        progress=False,
        jobs=4,
        parity=False,
        arm_defs={"X": {"mode": "clash"}, "Y": {"mode": "clash_always"}},
    )
    lines = [x.split() for x in (fake_cwd / "ports.txt").read_text().splitlines()]
    ports = [int(p) for _, _, p in lines]
    # every start, in parallel or again after a clash, had a port of its own, outside the ephemeral range
    assert len(set(ports)) == len(ports) and all(_PORT_RANGE[0] <= p < _PORT_RANGE[1] for p in ports)
    starts = {}
    for mode, seed, _ in lines:
        starts[(mode, int(seed))] = starts.get((mode, int(seed)), 0) + 1
    assert starts == {
        **{(m, s): 1 for m in ("signed_ema", "projected") for s in (0, 1)},
        **{("clash", s): 2 for s in (0, 1)},
        **{("clash_always", s): PORT_RETRIES + 1 for s in (0, 1)},
    }
    runs = {(r.arm, r.seed): r for r in rep.runs}
    assert all(runs[("X", s)].ok for s in (0, 1))  # a clash says nothing about the arm: the second start counts
    assert not any(runs[("Y", s)].ok for s in (0, 1))  # but a port that never frees is a crash, reported as one
    (row,) = [r for r in rep.rows if r.check == "runs finished" and r.arm == "Y"]
    assert row.passed is False and "EADDRINUSE" in row.note and row.note.startswith("crashed seeds [0, 1]; seed 0:")
