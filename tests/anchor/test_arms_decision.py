"""The anchor arms' decision on hand-made results: each threshold trips the verdict it should."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from lens_callbacks.anchor.arms import ArmsReport, RunResult, decide, run_config

COMM = 1000.0


def run(arm, seed, score, *, grad=1.0, comm=COMM, fires=None, status="ok", hash_="h", scores=None):
    """A finished run: ``grad`` is its largest gradient norm, ``comm`` its anchor traffic over two fires."""
    if fires is None:
        fires = (
            ()
            if arm == "off"
            else (
                {"t_fast": 4, "projected": False, "comm_bytes": comm / 2, "gated_on_fraction": 0.0},
                {
                    "t_fast": 8,
                    "projected": True,
                    "comm_bytes": comm / 2,
                    "gated_on_fraction": 0.0,
                    "weight_err_ratio": 1.5,
                    "coef_pred_error": 0.4,
                    "evr1": 0.95,
                    "evr1_null": 0.84,
                },
            )
        )
    if status != "ok":
        return RunResult(arm, seed, status, error="exit status 1\nValueError: boom", returncode=1)
    sc = scores if scores is not None else ((10, score / 2), (20, score))
    return RunResult(
        arm, seed, "ok", score=score, scores=sc, grad_norms=((0, grad / 2), (1, grad)), fires=fires, param_hash=hash_
    )


def base(a_scores=(0.50, 0.52, 0.54), c_scores=(0.50, 0.52, 0.54), **c_kw):
    out = [run("off", s, x, hash_=f"off{s}") for s, x in enumerate(a_scores)]
    out += [run("A", s, x) for s, x in enumerate(a_scores)]
    out += [run("C", s, x, **c_kw) for s, x in enumerate(c_scores)]
    return out


def parity(hash_="off0"):
    return RunResult("none", 0, "ok", score=0.5, scores=((10, 0.25), (20, 0.5)), param_hash=hash_)


def row(rep: ArmsReport, check: str, arm: str):
    (r,) = [r for r in rep.rows if r.check == check and r.arm == arm]
    return r


def test_all_safe_without_margin_stays_on_a_and_every_row_is_there():
    rep = decide(base(), parity())
    assert rep.verdict == "stay on A"
    assert all(r.passed for r in rep.rows if r.kind == "safety")
    assert row(rep, "margin (promotes C)", "C").passed is False
    for check, arm in [
        ("runs finished", "off"),
        ("runs finished", "A"),
        ("runs finished", "C"),
        ("off-path parity", "off"),
        ("comm bytes = arm A's", "C"),
        ("grad-norm stability", "A"),
        ("grad-norm stability", "C"),
        ("no regression", "C"),
        ("gated-ON ≈ 0 where projection does not help", "C"),
        ("coefficient-prediction error", "C"),
        ("EVR1 against its null", "C"),
    ]:
        row(rep, check, arm)
    # the JSON and the Markdown hold every row
    js = json.loads(json.dumps(rep.to_json()))
    assert [(r["check"], r["arm"]) for r in js["rows"]] == [(r.check, r.arm) for r in rep.rows]
    md = rep.markdown()
    assert all(r.check in md for r in rep.rows) and "**Verdict: stay on A**" in md
    assert "verdict: stay on A" in rep.render()


def test_aggregation_matches_numpy_paired_by_seed():
    a, c = [0.50, 0.55, 0.47], [0.58, 0.60, 0.57]
    rep = decide(base(a, c), parity())
    s = rep.arms["C"]
    d = np.array(c) - np.array(a)
    assert s.score_mean == pytest.approx(np.mean(c), abs=1e-15)
    assert s.score_std == pytest.approx(np.std(c, ddof=1), abs=1e-15)
    assert s.delta_mean == pytest.approx(d.mean(), abs=1e-15)
    assert s.delta_std == pytest.approx(d.std(ddof=1), abs=1e-15)
    # margin = max(0.010, 2σ): Δ ≈ 0.0767 against 2σ ≈ 0.0473
    assert 2 * d.std(ddof=1) > 0.010 and d.mean() > 2 * d.std(ddof=1)
    assert rep.verdict == "promote"


def test_regression_beyond_the_floor_stops():
    rep = decide(base(c_scores=(0.485, 0.505, 0.525)), parity())  # Δ = −0.015 every seed, σ = 0
    assert row(rep, "no regression", "C").passed is False
    assert rep.verdict == "stop" and "no regression" in rep.reason


@pytest.mark.parametrize("delta,ok", [(-0.0099, True), (-0.0101, False)])
def test_the_floor_is_0_010(delta, ok):
    a = (0.5, 0.6, 0.7)
    rep = decide(base(a, tuple(x + delta for x in a)), parity())
    assert row(rep, "no regression", "C").passed is ok
    assert rep.verdict == ("stay on A" if ok else "stop")


def test_a_drop_inside_the_seeds_noise_is_not_a_regression():
    # Δ per seed −0.06, +0.03, −0.015: mean −0.015 but 2σ ≈ 0.091, so −max(0.010, 2σ) ≈ −0.091
    rep = decide(base((0.5, 0.5, 0.5), (0.44, 0.53, 0.485)), parity())
    r = row(rep, "no regression", "C")
    assert r.passed is True and rep.verdict == "stay on A"


def test_grad_norm_nan_or_ten_times_arm_a_stops():
    rep = decide(base(grad=9.9), parity())
    assert row(rep, "grad-norm stability", "C").passed is True
    rep = decide(base(grad=10.5), parity())
    assert row(rep, "grad-norm stability", "C").passed is False and rep.verdict == "stop"
    rep = decide(base(grad=float("nan")), parity())
    assert row(rep, "grad-norm stability", "C").passed is False and rep.verdict == "stop"


def test_comm_bytes_must_equal_arm_a():
    rep = decide(base(comm=COMM + 8), parity())
    r = row(rep, "comm bytes = arm A's", "C")
    assert r.passed is False and rep.verdict == "stop"


def test_off_path_parity():
    rep = decide(base(), parity(hash_="something else"))
    assert row(rep, "off-path parity", "off").passed is False and rep.verdict == "stop"
    rep = decide(base(), None)  # arm off without its reference run
    assert row(rep, "off-path parity", "off").passed is False and rep.verdict == "stop"
    # same weights, different score trajectory: not bitwise the same run
    p = RunResult("none", 0, "ok", score=0.5, scores=((10, 0.2), (20, 0.5)), param_hash="off0")
    assert decide(base(), p).verdict == "stop"


def test_a_crashed_run_is_reported_and_stops():
    res = base()
    res[-1] = run("C", 2, 0.0, status="crashed")
    rep = decide(res, parity())
    r = row(rep, "runs finished", "C")
    assert r.passed is False and r.value == "2/3" and "[2]" in r.note
    assert rep.verdict == "stop"
    assert rep.arms["C"].n_ok == 2 and rep.arms["C"].score_mean == pytest.approx(np.mean([0.50, 0.52]), abs=1e-15)
    crashed = [r for r in rep.to_json()["runs"] if r["status"] == "crashed"]
    assert len(crashed) == 1 and "boom" in crashed[0]["error"]


def test_gated_on_must_be_near_zero_where_the_projection_does_not_help():
    def fires(ratio, gated):
        return (
            {"t_fast": 8, "projected": True, "comm_bytes": COMM, "gated_on_fraction": gated, "weight_err_ratio": ratio},
        )

    rep = decide(base(fires=fires(1.4, 0.30)), parity())
    assert row(rep, "gated-ON ≈ 0 where projection does not help", "C").passed is False and rep.verdict == "stop"
    rep = decide(base(fires=fires(1.4, 0.005)), parity())
    assert row(rep, "gated-ON ≈ 0 where projection does not help", "C").passed is True
    rep = decide(base(fires=fires(0.6, 0.30)), parity())  # the projection helps: the gate may be ON
    r = row(rep, "gated-ON ≈ 0 where projection does not help", "C")
    assert r.passed is True and "helps" in r.threshold


def test_ablation_b_is_reported_but_d_is_held_to_safety():
    res = base()
    res += [run("B", s, 0.2) for s in range(3)]  # B regresses badly: an ablation, reported only
    rep = decide(res, parity())
    assert row(rep, "no regression", "B").passed is False and row(rep, "no regression", "B").kind == "info"
    assert rep.verdict == "stay on A"
    res += [run("D", s, 0.2) for s in range(3)]
    rep = decide(res, parity())
    assert row(rep, "no regression", "D").passed is False and rep.verdict == "stop"


def test_a_score_never_logged_fails_and_names_the_logged_tags():
    res = [r for r in base() if r.arm != "C"]
    res += [
        RunResult(
            "C",
            s,
            "ok",
            grad_norms=((0, 1.0),),
            fires=run("C", s, 0).fires,
            param_hash="h",
            logged_tags=("train/loss", "val/acc"),
        )
        for s in range(3)
    ]
    rep = decide(res, parity(), settings={"score": "val/accuracy"})
    r = row(rep, "no regression", "C")
    assert r.passed is False and "val/accuracy" in r.note and "val/acc" in r.note
    assert rep.verdict == "stop"


def test_arm_a_is_required():
    with pytest.raises(ValueError, match="must include 'A'"):
        decide([run("C", 0, 0.5)])


def test_run_config_swaps_the_anchor_and_adds_the_recorder(tmp_path):
    cfg = {
        "trainer": {
            "max_steps": 5,
            "callbacks": [
                {"class_path": "x.Other", "init_args": {"k": 1}},
                {
                    "class_path": "lens_callbacks.callbacks.AnchorProjectionCallback",
                    "init_args": {"mode": "projected", "cadence": 4, "w_cap": 8},
                },
            ],
            "logger": {"class_path": "L"},
        },
        "model": {"class_path": "M"},
    }
    out = run_config(
        cfg, "B", tmp_path, anchor_args={"cadence": 2}, arm_args={"mode": "projected", "retro_gate": False}
    )
    cbs = out["trainer"]["callbacks"]
    assert cbs[0] == {"class_path": "x.Other", "init_args": {"k": 1}}
    assert cbs[1]["init_args"] == {"mode": "projected", "cadence": 2, "w_cap": 8, "retro_gate": False}
    assert cbs[2]["class_path"].endswith("ArmsRecorder") and cbs[2]["init_args"]["out"] == str(tmp_path / "record.json")
    assert out["trainer"]["default_root_dir"] == str(tmp_path) and out["trainer"]["logger"]["init_args"][
        "save_dir"
    ] == str(tmp_path)
    assert len(cfg["trainer"]["callbacks"]) == 2  # the user's config is left as it was
    none = run_config(cfg, "none", tmp_path)
    assert [c["class_path"].split(".")[-1] for c in none["trainer"]["callbacks"]] == ["Other", "ArmsRecorder"]


def test_docstring_example():
    import doctest

    import lens_callbacks.anchor.arms as mod

    res = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert res.attempted > 0 and res.failed == 0


def test_an_ablation_b_gate_left_on_is_reported_not_a_stop():
    fires = ({"t_fast": 8, "projected": True, "comm_bytes": COMM, "gated_on_fraction": 0.5, "weight_err_ratio": 2.0},)
    res = base() + [run("B", s, 0.52, fires=fires) for s in range(3)]
    rep = decide(res, parity())
    r = row(rep, "gated-ON ≈ 0 where projection does not help", "B")
    assert r.passed is False and r.kind == "info" and rep.verdict == "stay on A"


def test_figures_are_written_per_run_set(tmp_path):
    pytest.importorskip("matplotlib")
    from lens_callbacks.anchor.arms import figures

    rep = decide(base(), parity(), settings={"score": "val/accuracy"})
    written = figures(rep, tmp_path)
    assert sorted(p.name for p in written) == ["gated_on.png", "scores.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000


def test_an_anchor_that_refused_is_not_a_pass():
    import dataclasses

    res = base()
    res[-1] = dataclasses.replace(res[-1], refusal="anchor_gradient: the anchor's gradient could not be evaluated")
    rep = decide(res, parity())
    r = row(rep, "anchor refusals", "C")
    assert r.passed is False and "seed 2" in r.note and rep.verdict == "stop"
    assert row(rep, "anchor refusals", "A").passed is True


def with_grad(results, arm_bytes, note=""):
    """The runs with gradient traffic: ``arm_bytes`` maps arm → bytes (NaN: not counted)."""
    return [replace(r, grad_comm_bytes=arm_bytes.get(r.arm, 0.0), grad_comm_note=note, world_size=2) for r in results]


def test_comm_parity_is_over_gradients_plus_anchor():
    # counted and equal: passes, and the row shows the total with both parts
    rep = decide(with_grad(base(), {"off": 5000.0, "A": 5000.0, "C": 5000.0}), parity())
    r = row(rep, "comm bytes = arm A's", "C")
    assert r.passed is True and rep.verdict == "stay on A"
    assert r.value == "total 6000 (grad 5000 + anchor 1000) vs total 6000 (grad 5000 + anchor 1000)"
    assert rep.arms["C"].grad_comm_bytes == (5000.0,) * 3 and "grad comm bytes" in rep.render()

    # the anchor's bytes equal but the gradients' not (e.g. another rank r): the total differs, stop
    rep = decide(with_grad(base(), {"A": 5000.0, "C": 5008.0}), parity())
    r = row(rep, "comm bytes = arm A's", "C")
    assert r.passed is False and rep.verdict == "stop" and "grad 5008" in r.value

    # counted in one run only: not comparable, fails
    rep = decide(with_grad(base(), {"A": 5000.0, "C": math.nan}), parity())
    r = row(rep, "comm bytes = arm A's", "C")
    assert r.passed is False and "only one of the two runs" in r.note

    # counted in neither (a strategy without a counter): the anchor's bytes decide, and the note says so
    rep = decide(with_grad(base(), {"A": math.nan, "C": math.nan}, note="not counted: DDPStrategy"), parity())
    r = row(rep, "comm bytes = arm A's", "C")
    assert r.passed is True and r.value == "1000 vs 1000" and "anchor bytes only" in r.note
    rep = decide(with_grad(base(comm=COMM + 8), {"A": math.nan, "C": math.nan}), parity())
    assert row(rep, "comm bytes = arm A's", "C").passed is False


def test_single_process_has_no_gradient_traffic_and_says_so():
    rs = [replace(r, grad_comm_bytes=0.0, grad_comm_note="no gradient traffic (single process)") for r in base()]
    rep = decide(rs, parity())
    r = row(rep, "comm bytes = arm A's", "C")
    assert r.passed is True and r.value == "1000 vs 1000" and r.note == "no gradient traffic (single process)"
    assert (
        "no gradient traffic (single process)" in rep.render()
        and "no gradient traffic (single process)" in rep.markdown()
    )
    assert "| C | 3/3 |" in rep.markdown() and "| 1000 | 0 (single process) |" in rep.markdown()
    # and the result survives the JSON round trip the harness uses to read finished runs back
    back = RunResult.from_dict(json.loads(json.dumps(rs[3].to_dict())))
    assert (back.grad_comm_bytes, back.grad_comm_note) == (0.0, "no gradient traffic (single process)")
