"""The benchmark's memory probe reads known allocations, and the benchmark runs on one small size."""

from __future__ import annotations

import json

import pytest
import torch


def test_peak_probe_sees_a_known_peak_and_ignores_older_frees(bench_script):
    bench = bench_script("credit_cost")
    old = [torch.empty(500_000) for _ in range(4)]  # allocated before: freeing them must not offset the peak

    def fn():
        old.clear()  # 8 MB freed first: a plain running sum would never climb above zero
        a = torch.empty(1_000_000)  # 4 MB
        b = torch.empty(250_000)  # 1 MB, alive with a: peak 5 MB
        del a, b
        c = torch.empty(750_000)  # 3 MB after the peak
        del c

    peak = bench.peak_alloc_bytes(fn)
    assert 5_000_000 <= peak < 5_000_000 + 64 * 1024


def test_measure_and_section_writer(tmp_path, bench_script):
    pytest.importorskip("transformers")
    bench = bench_script("credit_cost")
    torch.set_num_threads(1)
    row = bench.measure(8, repeats=1, engines=("reference", "ghost", "ride"))
    assert row["m"] == 8 and row["B"] == 8 and row["audited_over_plain_train"] > 1.0
    assert row["reference_over_train"] > 0 and row["ride_over_train"] > -1.0
    assert row["conservation_error"] < 1e-5 and row["mem_audit"] > 0 and row["mem_ride"] > 0
    assert row["max_share_gap"] < 1e-5  # the ghost engine's shares against the reference engine's (float32)
    doc = tmp_path / "performance.md"
    doc.write_text("# Performance\n\n" + bench.SECTION + "\n\nold\n\n## Other\n\nkept\n")
    bench.write_section(doc, bench.table([row], 1))
    text = doc.read_text()
    assert "old" not in text and "## Other\n\nkept" in text and "| gpt2 | 8 | " in text


TINY = dict(vocab=4096, hidden=64, layers=1, intermediate=96, heads=4, kv_heads=2)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_route_counts_parameter_count_is_the_built_models(kind, bench_script):
    pytest.importorskip("transformers")
    bench, counts = bench_script("credit_cost"), bench_script("route_counts")
    model = bench.make_real_model(kind, 32, **TINY)
    shape = {**bench.REAL_SHAPES[kind], **TINY}
    assert counts.n_params(shape) == sum(p.numel() for p in model.parameters())
    assert model.config.tie_word_embeddings == (kind == "qwen2")
    c = counts.route_counts(shape, 8, 128)
    # a step is forward + backward; riding along adds at least the per-row products of every weight
    assert c["step"].macs > c["separate"].macs - c["ride"].macs - 1 and c["ride"].macs > 0
    assert counts.route_counts(shape, 8, 128, readings="all")["ride"].macs >= c["ride"].macs
    with pytest.raises(ValueError, match="readings"):
        counts.route_counts(shape, 8, 128, readings="projected")


def test_real_shape_row_runs_at_a_tiny_vocabulary_and_writes_its_own_block(tmp_path, bench_script):
    pytest.importorskip("transformers")
    bench = bench_script("credit_cost")
    torch.set_num_threads(1)
    row = bench.measure_real(
        "qwen2",
        3,
        24,
        1,
        modes=("step", "ride_shares", "sep_shares", "trainer", "trainer_all", "vmap"),
        memory=False,
        drift=True,
        **TINY,
    )
    assert row["tied"] and row["vocab"] == 4096 and row["step_s"] > 0
    assert row["ride_shares_over_train"] > -1.0 and row["sep_shares_over_train"] > 0 and row["vmap_over_train"] > 0
    assert row["conservation_error"] < 1e-5 and row["sum_shares_err_f64"] < 1e-12 and row["drift"] < 1e-3
    if bench.resource is not None:  # one thread: a call's CPU time cannot much exceed its wall time
        assert set(row["cpu"]) == {"step", "ride_shares", "sep_shares", "trainer", "trainer_all", "vmap"}
        user, sys_s, faults = row["cpu"]["step"]  # the kernel counts CPU time in ticks: slack for one
        assert 0 <= user + sys_s <= 1.5 * row["step_s"] + 0.05 and min(user, sys_s, faults) >= 0
    text = bench.real_table([row], 1, ["llama, m = 32, T = 512: dropped"]) + bench.real_verdict([row])
    assert "| qwen2 |" in text and "dropped" in text and "riding on the step" in text
    assert row["trainer_all_over_train"] > 0 and "all readings with `g_full` from the step's `.grad`" in text
    assert ("CPU time a call" in text) == (bench.resource is not None)
    doc = tmp_path / "performance.md"
    doc.write_text(
        "# Performance\n\n"
        + bench.SECTION
        + "\n\ntoy\n\n"
        + bench.GENERATED_END
        + "\n\nkept\n\n"
        + bench.REAL_SECTION
        + "\n\nold\n\n"
        + bench.REAL_END
        + "\n\nanalysis\n\n## Other\n"
    )
    bench.write_section(doc, text, bench.REAL_SECTION, bench.REAL_END)
    out = doc.read_text()
    assert "old" not in out and "toy" in out and "kept" in out and "analysis\n\n## Other" in out and "| qwen2 |" in out
    with pytest.raises(ValueError, match="overrides"):
        bench.make_real_model("llama", 32, width=3)


def test_gpu_script_parses_and_builds_at_a_tiny_shape_on_cpu(bench_script):
    pytest.importorskip("transformers")
    gpu = bench_script("credit_cost_gpu")
    args = gpu.parse_args([])
    assert (args.vocab, args.hidden, args.layers, args.intermediate, args.parts, args.tokens, args.dtype) == (
        151936,
        896,
        24,
        4864,
        64,
        512,
        "bfloat16",
    )
    args = gpu.parse_args(
        [
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--parts",
            "2",
            "--tokens",
            "12",
            "--vocab",
            "256",
            "--hidden",
            "32",
            "--layers",
            "1",
            "--intermediate",
            "48",
            "--heads",
            "4",
            "--kv-heads",
            "2",
        ]
    )
    policy, batch, opt = gpu.build(args)
    assert batch[0].shape == (2, 12) and policy.model.config.tie_word_embeddings
    fns = gpu.modes(policy, batch, opt)
    assert set(fns) == set(gpu.MODES)
    fns["ride_shares"]()  # raises if the ride-along audit falls back
    with pytest.raises(SystemExit):
        gpu.parse_args(["--hidden", "30", "--heads", "4"])


def test_rows_from_merges_a_later_modes_run_into_the_row(tmp_path, capsys, bench_script):
    # a row's full run (vmap skipped for memory), then a run of the peers alone (`--modes step vmap`): the
    # rendered row takes vmap's ratio from the second run and says which run timed it
    bench = bench_script("credit_cost")
    full = {
        "kind": "llama",
        "m": 8,
        "T": 128,
        "n_params": 1_000_000,
        "param_bytes": 4_000_000,
        "step_s": 4.0,
        "repeats": 2,
        "skipped": {"vmap": "needs 5 GiB"},
        "sep_shares_over_train": 1.4,
        "sep_all_over_train": 1.5,
        "mem_step": 0,
        "mem_sep_all": 1_000_000,
    }
    peers = {
        "kind": "llama",
        "m": 8,
        "T": 128,
        "n_params": 1_000_000,
        "param_bytes": 4_000_000,
        "step_s": 5.0,
        "repeats": 1,
        "skipped": {},
        "vmap_over_train": 1.7,
        "modes": ["step", "vmap"],
        "cpu": {"step": [4.0, 0.5, 120_000], "vmap": [6.0, 1.25, 300_000]},
    }
    log = tmp_path / "rows.log"
    log.write_text("\n".join(json.dumps(r) for r in (full, {**peers, "partial": "timings only"}, peers)) + "\n")
    bench.main(["--only", "real", "--rows-from", str(log), "--real-rows", "llama:8:128"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| llama | 1 M | 8 | 128 |"))
    assert "| 4.00 |" in row and "| 1.40× |" in row and "| 1.70× |" in row and "(+0.2)" in row
    assert out.count("vmap timed in a separate run (`--modes`), against that run's plain step (5.00 s)") == 1
    assert "vmap not run" not in out
    assert "1 of 1 rows where a peer ran" in out  # 1.5 against vmap's 1.7
    # the peers' run's CPU time, against that run's own step: 6.0 / 4.0 s of user time
    assert (
        "llama, m = 8, T = 128 (the `--modes step vmap` run): CPU time a call (medians): user time against the "
        "step's, system seconds, minor page faults — step 4.00 s user, 0.50 s, 120k; vmap 1.50×, 1.25 s, 300k."
    ) in out


@pytest.mark.parametrize("compare", ["paths", "cut"])
def test_direct_route_ab_runs_both_ways_and_puts_the_route_back(compare, bench_script):
    pytest.importorskip("transformers")
    ab = bench_script("direct_route_ab")
    from lens_callbacks.credit.engines import ghost, ghost_routes

    before = (ghost.direct_param, ghost_routes._by_part, ghost_routes._cut)
    torch.set_num_threads(1)
    r = ab.measure_ab("llama", 8, 16, 1, compare=compare, prompt=0.5, **TINY)
    assert (ghost.direct_param, ghost_routes._by_part, ghost_routes._cut) == before
    assert list(r["paths"]) == list(ab.COMPARE[compare])
    assert r["share_gap"] < 1e-6 and max(r["conservation_error"].values()) < 1e-5
    for p in r["paths"].values():  # the tiny head (4096 × 64 at m = 8) is read by the direct route
        assert p["over_step"] > 0 and 0 < p["largest_s"] <= p["direct_s"]


def test_direct_route_ab_refuses_an_unknown_comparison_and_a_prompt_out_of_range(bench_script):
    ab = bench_script("direct_route_ab")
    with pytest.raises(ValueError, match="`compare` must be one of"):
        ab.measure_ab("llama", 8, 16, 1, compare="speed")
    with pytest.raises(ValueError, match=r"`prompt` must be a share of the row in \[0, 1\), got 1.5"):
        ab.measure_ab("llama", 8, 16, 1, prompt=1.5)


def test_apart_readings_equal_the_timed_process_ones_and_merge_into_its_row(tmp_path, capsys, bench_script):
    # `--apart` makes each memory or drift reading in a child process of its own (for rows whose profiled
    # passes do not fit in one process): the child's peak is the one the timed process reads, and
    # --rows-from puts it into the timed row's cells
    pytest.importorskip("transformers")
    bench = bench_script("credit_cost")
    torch.set_num_threads(1)
    row = bench.measure_real("qwen2", 3, 24, 1, modes=("step", "sep_shares"), memory=True, drift=False, **TINY)
    shape = [f"--shape={k}={v}" for k, v in TINY.items()]
    bench.main(["--only", "real", "--real-rows", "qwen2:3:24", "--apart", "mem_sep_shares", "drift", *shape])
    apart = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert apart["apart"] == ["mem_sep_shares", "drift"] and apart["failed"] == {}
    assert apart["mem_sep_shares"] == row["mem_sep_shares"]
    assert 0 < apart["drift"] < 1e-6 and apart["sum_shares_err_f64"] < 1e-12 and apart["conservation_error"] < 1e-5

    timed = {k: v for k, v in row.items() if k != "mem_sep_shares"}
    log = tmp_path / "rows.log"
    log.write_text(
        json.dumps(timed) + "\n" + json.dumps({**apart, "failed": {"mem_trainer": "exit status -9: Killed"}}) + "\n"
    )
    bench.main(["--only", "real", "--rows-from", str(log), "--real-rows", "qwen2:3:24"])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("| qwen2 |"))
    extra = (row["mem_sep_shares"] - row["mem_step"]) / row["param_bytes"]
    assert f"| {row['sep_shares_over_train']:.2f}× ({extra:+.1f}) |" in line
    assert f"| {apart['drift']:.1e} |" in line
    assert "qwen2, m = 3, T = 24: drift, mem_sep_shares read each in a process of its own (`--apart`)." in out
    assert "qwen2, m = 3, T = 24: mem_trainer (`--apart`) failed — exit status -9: Killed." in out


def test_apart_records_a_child_that_fails_and_goes_on(monkeypatch, capsys, bench_script):
    import subprocess

    bench = bench_script("credit_cost")
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        reading = cmd[cmd.index("--reading") + 1]
        if reading == "mem_step":  # killed for memory: no output
            return subprocess.CompletedProcess(cmd, -9, "", "")
        out = json.dumps({"kind": "llama", "m": 8, "T": 128, "param_bytes": 4, "apart": [reading], reading: 12})
        return subprocess.CompletedProcess(cmd, 0, "noise\n" + out + "\n", "")

    monkeypatch.setattr(bench.subprocess, "run", run)
    got = bench.measure_apart("llama", 8, 128, ("mem_step", "mem_trainer"), seed=3, vocab=512)
    assert got["failed"] == {"mem_step": "exit status -9: no output"} and got["apart"] == ["mem_trainer"]
    assert got["mem_trainer"] == 12 and "mem_step" not in got
    assert all("--shape=vocab=512" in c and c[c.index("--seed") + 1] == "3" for c in calls) and len(calls) == 2
    with pytest.raises(SystemExit):
        bench.main(["--only", "real", "--apart", "--shape", "vocab"])
    assert "a shape override must be KEY=INTEGER" in capsys.readouterr().err
    with pytest.raises(ValueError, match="`reading` must be one of"):
        bench.measure_reading("llama", 2, 8, "mem_nothing")


def test_pass_split_times_the_reductions_inside_the_pass_and_puts_the_engine_back(capsys, monkeypatch, bench_script):
    # pass_split.py wraps each parameter's reduction, the direct route's per-row products, the dead-end
    # scans, the conservation differences, the reads of each piece and what follows the backward with
    # timers (wall and user CPU time): the middle four are parts of the reductions, the reductions and the
    # end parts of the pass, and the engine is the same after the run as before it
    pytest.importorskip("transformers")
    split = bench_script("pass_split")
    from lens_callbacks.credit.engines import ghost, ghost_routes

    monkeypatch.setattr(
        ghost_routes, "_CUT_MIN", 0
    )  # the dead ends looked for at this tiny shape too, as at a real one

    def engine():
        return (
            ghost._Reducer.param,
            ghost._Reducer.finish,
            ghost.diff_sq64,
            ghost._sum_sq,
            ghost.grad_match_to,
            ghost.build_report,
            ghost_routes.torch,
            ghost_routes._cut,
            ghost_routes.diff_sq64,
            ghost_routes.sq64,
            ghost_routes.read_piece,
        )

    before = engine()
    torch.set_num_threads(1)
    r = split.measure_split("llama", 8, 16, 1, **TINY)
    assert engine() == before
    s = r["seconds"]
    # the tiny head (4096 × 64 at m = 8) is read by the direct route, one part's piece at a time: its
    # products, dead-end scans and differences are parts of the reductions, which are part of the pass
    assert s["products"] > 0 and s["scans"] > 0 and s["differences"] > 0 and s["reads"] > 0
    assert s["products"] + s["scans"] + s["differences"] + s["reads"] <= s["reductions"]
    # what follows the backward (the batched small parameters, ‖g_full‖², grad_match, the report) is timed
    # apart from the reductions, and both lie inside the pass
    assert s["end"] > 0 and s["reductions"] + s["end"] <= s["pass"]
    # the same parts by user CPU time (what the kernel charges for fresh memory left out), each within its call
    u = r["user"]
    assert u["step"] > 0 and u["pass"] > 0
    assert all(
        0 <= u[k] <= u["pass"] + 0.02 for k in ("reductions", "products", "scans", "differences", "reads", "end")
    )
    assert r["conservation_error"] < 1e-5
    text = split.render(r)
    assert text.startswith("llama, m = 8, T = 16, 1 repeats;")
    lines = text.splitlines()  # a wall row and a user-time row: the pass, then its parts, each over the step's
    wall, user = ([float(x) for x in line.strip("| ").split(" | ")[1:]] for line in (lines[3], lines[4]))
    assert lines[3].startswith("| wall |") and lines[4].startswith("| user CPU |")
    assert wall[0] == pytest.approx(r["over_step"]["pass"], abs=5e-4)
    assert user[0] == pytest.approx(u["pass"] / u["step"], abs=5e-4)
    assert wall[3] == pytest.approx(s["end"] / s["step"], abs=5e-4)
    # each call's CPU time, listed under the table with the pass's user time over the step's
    cpu = r["cpu"]
    assert set(cpu) == {"step", "fwd_bwd", "pass"} and cpu["step"][0] > 0 and cpu["pass"][0] > 0
    assert text.splitlines()[-1].endswith(
        f"pass {cpu['pass'][0] / cpu['step'][0]:.2f}×, {cpu['pass'][1]:.2f} s, {cpu['pass'][2] / 1e3:.0f}k"
    )
    with pytest.raises(ValueError, match="`repeats` must be at least 1, got 0"):
        split.measure_split("llama", 8, 16, 0, **TINY)
    # from the command line the same value is a usage error naming it, not a traceback
    with pytest.raises(SystemExit) as exc:
        split.main(["--repeats", "0"])
    assert exc.value.code == 2 and "`repeats` must be at least 1, got 0." in capsys.readouterr().err


def test_fused_reads_times_the_engines_reads_against_one_fused_kernel_with_the_same_numbers(capsys, bench_script):
    # fused_reads.py times ghost_routes.read_piece (the direct route's reads of one part's block) against
    # the same reductions compiled into one kernel; "eager" compiles without a C++ compiler
    fused = bench_script("fused_reads")
    torch.set_num_threads(1)
    r = fused.measure(64, 48, blocks=10, calls=20, backend="eager")
    assert r["eager_s"] > 0 and r["fused_s"] > 0
    assert r["max_rel_diff"] < 1e-5  # same dots and squared norms, to float32 rounding
    assert r["saved_s"] == pytest.approx(10 * (r["eager_s"] - r["fused_s"]))
    assert fused.render(r).startswith("one part's block [64, 48], float32, eager: eager reads ")
    with pytest.raises(ValueError, match="`blocks` must be at least 1, got 0"):
        fused.measure(64, 48, blocks=0)
    with pytest.raises(SystemExit):
        fused.main(["--rows", "0"])
    assert "`rows` must be at least 1, got 0." in capsys.readouterr().err
