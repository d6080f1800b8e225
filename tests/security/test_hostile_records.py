"""Hostile and broken run records through `lens-callbacks audit` (and `process`): nothing runs, one line, exit 2.

A record is built once by a real two-step training run (RunRecordCallback on the tools example); each
case copies it, breaks one thing, and runs the real command in a forked child (isolated.py) with a marker
file that any executed payload would create.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import hostile as H
import pytest
import torch

pytest.importorskip("transformers")

# A real training run builds the record and a worker imports lightning and transformers once (about 30 s
# on 2 shared cores); every case after that takes a fraction of a second.
pytestmark = pytest.mark.slow


def _copy(record: Path, tmp: Path) -> Path:
    dst = tmp / "record"
    shutil.copytree(record, dst)
    return dst


def _refused(r, *needles: str, marker: Path = None) -> str:
    lines = r.stderr.splitlines()
    assert r.rc == 2 and not r.timed_out, (r.rc, r.stderr[-3000:], r.stdout[-500:])
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert r.peak_mb < 1500, r.peak_mb
    if marker is not None:
        assert not marker.exists(), f"the record ran code: {marker} exists"
    return lines[0]


def _manifest(rec: Path) -> Path:
    return rec / "record.json"


def _traj(rec: Path, step: int) -> Path:
    return rec / "trajectories" / f"step_{step:06d}.jsonl"


def _meta(rec: Path, step: int) -> Path:
    return rec / "steps" / f"step_{step:06d}.json"


def _edit_lines(path: Path, edit) -> None:
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    edit(lines)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def _set_token(step: int, value: int):
    def edit(rec: Path) -> None:
        def f(lines):
            turn = next(t for t in lines[0]["turns"] if t["token_ids"])
            turn["token_ids"][0] = value

        _edit_lines(_traj(rec, step), f)

    return edit


def _write_raw(rel: str, text: str):
    def edit(rec: Path) -> None:
        (rec / rel).write_text(text)

    return edit


def _reward(step: int, raw: str):
    def edit(rec: Path) -> None:
        p = _traj(rec, step)
        lines = p.read_text().splitlines()
        d = json.loads(lines[0])
        d["reward"] = 12345.5
        lines[0] = json.dumps(d).replace("12345.5", raw)
        p.write_text("\n".join(lines) + "\n")

    return edit


def _policy(change):
    def edit(rec: Path) -> None:
        p = rec / "policy_step_000000.pt"
        sd = torch.load(p, weights_only=True)
        out = change(sd)
        if isinstance(out, bytes):
            p.write_bytes(out)
        else:
            torch.save(sd, p)

    return edit


def _reshape_first(sd):
    k = next(iter(sd))
    sd[k] = torch.zeros(3, 3)


def _drop_first(sd):
    sd.pop(next(iter(sd)))


def _dropout_1e400(rec: Path) -> None:
    H.edit_json(_manifest(rec), lambda m: m["init_args"].update(dropout=12345.5))
    _manifest(rec).write_text(_manifest(rec).read_text().replace("12345.5", "1e400"))  # parses as inf


TRACEBACK_CASES = {
    # name: (edit of the record dir, words the one line must hold)
    "steps_holding_null": (
        lambda r: H.edit_json(_manifest(r), lambda m: m["steps"].append(None)),
        ["record.json", "`steps[2]`"],
    ),
    "manifest_is_a_list": (lambda r: _manifest(r).write_text("[1, 2]"), ["record.json", "JSON object", "list"]),
    "n_embd_big": (
        lambda r: H.edit_json(_manifest(r), lambda m: m["init_args"].update(n_embd="big")),
        ["`init_args.n_embd`", "'big'"],
    ),
    "token_id_beyond_vocab_audited_step": (
        _set_token(1, 10**6),
        ["step_000001.jsonl", "`token_ids`", "1000000", "vocabulary"],
    ),
    "token_id_negative_audited_step": (_set_token(1, -3), ["step_000001.jsonl", "`token_ids`", "-3"]),
    "token_id_beyond_vocab_earlier_step": (_set_token(0, 10**6), ["step_000000.jsonl", "`token_ids`", "vocabulary"]),
    "token_id_negative_earlier_step": (_set_token(0, -1), ["step_000000.jsonl", "`token_ids`", "-1"]),
    "policy_random_bytes": (_policy(lambda sd: H.garbage()), ["policy_step_000000.pt", "not a torch.save zip archive"]),
    "policy_wrong_shapes": (_policy(_reshape_first), ["policy_step_000000.pt", "does not fit", "size mismatch"]),
    "policy_missing_keys": (_policy(_drop_first), ["policy_step_000000.pt", "does not fit", "Missing key"]),
    "step_meta_lr_abc": (
        lambda r: H.edit_json(_meta(r, 0), lambda m: m.update(lr="abc")),
        ["step_000000.json", "`lr`", "'abc'"],
    ),
    "step_meta_is_a_list": (
        _write_raw("steps/step_000000.json", "[]"),
        ["step_000000.json", "step meta must be a JSON object"],
    ),
    "step_meta_lr_nan": (_write_raw("steps/step_000000.json", '{"lr": [NaN]}'), ["step_000000.json", "NaN"]),
    "step_meta_lr_1e400": (
        _write_raw("steps/step_000000.json", '{"lr": [1e400]}'),
        ["step_000000.json", "`lr[0]`", "inf"],
    ),
    "step_meta_dropout_seed_text": (
        lambda r: H.edit_json(_meta(r, 0), lambda m: m.update(dropout_seed="7")),
        ["`dropout_seed`"],
    ),
    "no_init_args": (
        lambda r: H.edit_json(_manifest(r), lambda m: m.pop("init_args")),
        ["record.json", "`init_args` is missing"],
    ),
    "init_arg_missing": (
        lambda r: H.edit_json(_manifest(r), lambda m: m["init_args"].pop("dropout")),
        ["`init_args` is missing", "dropout"],
    ),
    "init_arg_unknown": (
        lambda r: H.edit_json(_manifest(r), lambda m: m["init_args"].update(bogus=1)),
        ["`init_args`", "bogus"],
    ),
    "init_arg_dropout_1e400": (_dropout_1e400, ["`init_args.dropout`", "inf"]),
    "reward_nan": (_reward(1, "NaN"), ["step_000001.jsonl:1", "NaN"]),
    "reward_infinity": (_reward(1, "-Infinity"), ["step_000001.jsonl:1", "Infinity"]),
    "reward_1e400": (_reward(1, "1e400"), ["step_000001.jsonl:1", "`reward` must be finite"]),
    "manifest_truncated": (
        lambda r: _manifest(r).write_text(_manifest(r).read_text()[:40]),
        ["record.json", "not valid JSON"],
    ),
    "manifest_deeply_nested": (
        lambda r: _manifest(r).write_text("[" * 100000 + "]" * 100000),
        ["record.json", "not valid JSON"],
    ),
    "world_size_text": (
        lambda r: H.edit_json(_manifest(r), lambda m: m["trainer"].update(world_size="two")),
        ["`trainer.world_size`"],
    ),
    "trainer_missing": (lambda r: H.edit_json(_manifest(r), lambda m: m.pop("trainer")), ["`trainer` is missing"]),
    "turns_not_a_list": (
        lambda r: _edit_lines(_traj(r, 1), lambda ls: ls[0].update(turns="x")),
        ["step_000001.jsonl:1", "`turns`"],
    ),
    "trajectory_line_garbage": (
        _write_raw("trajectories/step_000001.jsonl", "{nope\n"),
        ["step_000001.jsonl:1", "not valid JSON"],
    ),
    "manifest_symlink_to_dev_zero": (
        lambda r: (_manifest(r).unlink(), _manifest(r).symlink_to("/dev/zero")),
        ["record.json", "character device"],
    ),
    "trajectories_fifo": (
        lambda r: (_traj(r, 1).unlink(), H.os.mkfifo(_traj(r, 1))),
        ["step_000001.jsonl", "named pipe"],
    ),
    "steps_not_int": (lambda r: H.edit_json(_manifest(r), lambda m: m.update(steps=["0", 1])), ["`steps[0]`"]),
}


@pytest.mark.parametrize("case", sorted(TRACEBACK_CASES))
def test_broken_record_is_one_line_naming_the_field(heavy, record, tmp_path, case):
    edit, needles = TRACEBACK_CASES[case]
    rec = _copy(record, tmp_path)
    edit(rec)
    r = heavy.run("audit", rec, "--step", "1", "--no-progress", cwd=tmp_path, timeout=60)
    _refused(r, *needles)


# ------------------------------------------------------------------------------------- the trust boundary
def _names(module=None, builder=None, init_args=None):
    def edit(rec: Path) -> None:
        def f(m):
            if module is not None:
                m["module"] = module
            if builder is not None:
                m["batch_builder"] = builder
            if init_args is not None:
                m["init_args"] = init_args

        H.edit_json(_manifest(rec), f)

    return edit


def _evil_package(tmp: Path, marker: Path) -> None:
    pkg = tmp / "evilpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\nclass Policy:\n    pass\n"
    )


@pytest.mark.parametrize(
    "case",
    [
        "module_os_system",
        "builder_os_system",
        "module_in_cwd_package",
        "builder_in_cwd_package",
        "module_is_a_function",
        "builder_is_a_class",
        "module_without_credit_terms",
    ],
)
def test_a_record_runs_nothing_it_names_unless_trusted(heavy, record, tmp_path, case):
    marker = tmp_path / "MARKER"
    _evil_package(tmp_path, marker)
    rec = _copy(record, tmp_path)
    edit, needles, extra = {
        "module_os_system": (
            _names(module="os.system", init_args={"command": f"touch {marker}"}),
            ["`module`", "'os.system'"],
            [],
        ),
        "builder_os_system": (_names(builder="os.system"), ["`batch_builder`", "'os.system'"], []),
        "module_in_cwd_package": (_names(module="evilpkg.Policy"), ["`module`", "evilpkg"], []),
        "builder_in_cwd_package": (_names(builder="evilpkg.Policy"), ["`batch_builder`", "evilpkg"], []),
        "module_is_a_function": (
            _names(module="lens_callbacks.io.safe.read_regular_file"),
            ["`module`", "must name a"],
            [],
        ),
        "builder_is_a_class": (
            _names(builder="lens_callbacks.examples.grpo.module.RolloutBatch"),
            ["`batch_builder`", "Python function"],
            [],
        ),
        "module_without_credit_terms": (
            _names(module="torch.nn.Linear"),
            ["`module`", "credit_terms"],
            ["--allow-module", "torch"],
        ),
    }[case]
    edit(rec)
    r = heavy.run("audit", rec, "--step", "1", "--no-progress", *extra, cwd=tmp_path)
    _refused(r, *needles, marker=marker)


def test_allow_module_is_what_lets_a_package_run(heavy, record, tmp_path):
    """The same record with --allow-module imports the package (its code runs): the check above is what stopped it."""
    marker = tmp_path / "MARKER"
    _evil_package(tmp_path, marker)
    rec = _copy(record, tmp_path)
    _names(module="evilpkg.Policy")(rec)
    r = heavy.run("audit", rec, "--step", "1", "--no-progress", "--allow-module", "evilpkg", cwd=tmp_path)
    assert marker.exists()  # imported, as asked ...
    _refused(r, "`module`", "must name a LightningModule")  # ... but Policy is no nn.Module, so it is never called


def test_an_examples_package_in_the_working_directory_is_not_trusted_by_name(light, record, tmp_path):
    """`audit` puts the working directory first on sys.path; the examples ship inside lens_callbacks, so a
    record naming a top-level `examples` (as records did before) is outside the default trust and nothing runs."""
    marker = tmp_path / "MARKER"
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "__init__.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    rec = _copy(record, tmp_path)
    _names(module="examples.grpo_tools.module.GRPOToolsModule")(rec)
    r = light.run("audit", rec, "--step", "1", "--no-progress", cwd=tmp_path)
    _refused(r, "`module`", "outside the modules a record may name by default", "nothing was imported", marker=marker)


def test_help_states_the_trust_default(heavy):
    r = heavy.run("audit", "--help")
    text = " ".join(r.stdout.split())
    assert (
        r.rc == 0
        and "--trust-record" in text
        and "--allow-module" in text
        and "lens_callbacks and its examples only" in text
    )


# ------------------------------------------------------------------------------------- clean records, as before
def test_clean_record_audits_as_before(heavy, record, tmp_path):
    from lens_callbacks.commands.audit import audit_record

    r = heavy.run("audit", record, "--step", "1", "--no-progress", "--json", cwd=tmp_path, timeout=120)
    assert r.rc == 0 and r.stderr == "", r.stderr
    got = json.loads(r.stdout)
    ref = audit_record(record, 1, progress=False).to_dict("credit/")
    assert got.keys() == ref.keys()
    for k, v in ref.items():
        assert (got[k] is None and not math.isfinite(v)) or got[k] == v, k
    assert abs(sum(v for k, v in ref.items() if k.startswith("credit/projected_share/"))) == pytest.approx(
        1.0, abs=1e-6
    )


def test_process_refuses_a_record_with_a_nan_reward(light, record, tmp_path):
    rec = _copy(record, tmp_path)
    _reward(0, "NaN")(rec)
    r = light.run("process", rec, "--no-progress")
    _refused(r, "step_000000.jsonl:1", "NaN")
