"""read_skyrl_dump on SkyRL's own dumps: content checked against torch's own copy of the tensors."""

from __future__ import annotations

import collections
import io
import math
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from skyrl_fixtures import CURRENT, HOSTILE, LEGACY, ROOT, TRUNCATED, needs_fixtures  # noqa: E402

from lens_callbacks.io import SkyRLDump, read_skyrl_dump
from lens_callbacks.io.skyrl import ForbiddenGlobalError, SkyRLDumpError

KEYS_CURRENT = [
    "sequences",
    "attention_mask",
    "response_mask",
    "loss_mask",
    "rollout_logprobs",
    "rollout_expert_indices",
    "router_padding_mask",
    "pixel_values",
    "image_grid_thw",
    "base_action_log_probs",
    "action_log_probs",
    "values",
    "returns",
    "advantages",
]
KEYS_LEGACY = [
    k
    for k in KEYS_CURRENT
    if k not in {"rollout_expert_indices", "router_padding_mask", "pixel_values", "image_grid_thw"}
]
PROMPTS = [
    [151644, 872, 198, 8427, 15744, 22320],
    [151644, 872, 198, 7395, 4266],
    [151644, 872, 198, 9875, 18635, 23723],
]


# ---------------------------------------------------------------------------------------------
# Independent references: torch's own loaders (weights_only=True) on the payloads the files embed.


class _Dict(dict):
    def __setstate__(self, state):
        self.state = state


def _legacy_torch_copy() -> dict:
    """The legacy file's raw tensors (stored a second time by torch's reducer), loaded by torch itself."""

    class U(pickle.Unpickler):
        def find_class(self, module, name):
            return {
                ("skyrl_train.training_batch", "TrainingInputBatch"): _Dict,
                ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
                ("torch.storage", "_load_from_bytes"): lambda b: torch.load(io.BytesIO(b), weights_only=True),
                ("collections", "OrderedDict"): collections.OrderedDict,
                ("torch", "device"): torch.device,
            }[(module, name)]

    with open(LEGACY, "rb") as f:
        return dict(U(f).load())


def _current_state() -> dict:
    class U(pickle.Unpickler):
        def find_class(self, module, name):
            return {
                ("skyrl.backends.skyrl_train.training_batch", "_rebuild_tensor_batch"): lambda cls, state: state,
                ("skyrl.backends.skyrl_train.training_batch", "TrainingInputBatch"): object,
                ("torch", "device"): torch.device,
            }[(module, name)]

    with open(CURRENT, "rb") as f:
        return U(f).load()


@pytest.fixture(scope="module")
def current() -> SkyRLDump:
    return read_skyrl_dump(CURRENT)


@pytest.fixture(scope="module")
def legacy() -> SkyRLDump:
    return read_skyrl_dump(LEGACY)


@pytest.fixture(scope="module")
def raw() -> dict:
    return _legacy_torch_copy()


def _response_lengths(d: SkyRLDump) -> list[int]:
    return [int(x) for x in d.batch["response_mask"].sum(-1).tolist()]


def _realign_to_legacy(t: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Current response tensors are right-aligned; move row k's last r_k columns to the front."""
    out = torch.zeros_like(t)
    for k, r in enumerate(lengths):
        out[k, :r] = t[k, t.shape[1] - r :]
    return out


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["current", "legacy"])
@needs_fixtures
def test_shapes_dtypes_and_padding(which, request):
    d = request.getfixturevalue(which)
    keys = KEYS_CURRENT if which == "current" else KEYS_LEGACY
    assert list(d.batch) == keys
    assert d.layout == which
    assert d.step == (3 if which == "current" else 1)
    assert d.pad_size == 2 and d.metadata["pad_size"] == 2 and d.n_rows == 12  # 14 rows, 2 padding dropped
    want = {
        "sequences": ([12, 16], torch.int64),
        "attention_mask": ([12, 16], torch.int64),
        "response_mask": ([12, 10], torch.int64),
        "loss_mask": ([12, 10], torch.float32),
        "rollout_logprobs": ([12, 10], torch.bfloat16 if which == "current" else torch.float32),
        "base_action_log_probs": ([12, 10], torch.float32),
        "action_log_probs": ([12, 10], torch.float32),
        "returns": ([12, 10], torch.float32),
        "advantages": ([12, 10], torch.float32),
    }
    for key, (shape, dtype) in want.items():
        assert list(d.batch[key].shape) == shape and d.batch[key].dtype == dtype, key
    for key in set(keys) - set(want):
        assert d.batch[key] is None, key
    assert (d.batch["loss_mask"].sum(-1) > 0).all()  # no padding row (loss_mask all zero) is left
    assert isinstance(d.metadata["metrics"], dict) and d.metadata["response_length"] == 10


@needs_fixtures
def test_legacy_equals_torchs_own_copy_of_its_tensors(legacy, raw):
    for key, t in legacy.batch.items():
        if t is None:
            assert raw[key] is None
            continue
        assert t.dtype == raw[key].dtype, key
        assert torch.equal(t, raw[key][:12]), key
    # the padding rows carry non-zero advantages: they are dropped by count, not by a zero test
    assert raw["advantages"].shape[0] == 14 and raw["advantages"][12].abs().max() > 0.9


@needs_fixtures
def test_current_equals_legacy_after_realignment_and_bf16_equals_torch_load(current, legacy):
    lengths = _response_lengths(current)
    assert lengths == _response_lengths(legacy)
    for k in range(12):
        cur_real = current.batch["sequences"][k][current.batch["attention_mask"][k] == 1]
        leg_real = legacy.batch["sequences"][k][legacy.batch["attention_mask"][k] == 1]
        assert torch.equal(cur_real, leg_real), k
    for key in ("response_mask", "loss_mask", "advantages"):
        assert torch.equal(_realign_to_legacy(current.batch[key], lengths), legacy.batch[key]), key
    resp = legacy.batch["response_mask"] == 1
    key = "action_log_probs"
    assert torch.equal(_realign_to_legacy(current.batch[key], lengths)[resp], legacy.batch[key][resp])
    # bfloat16: the reader's numpy decoding against torch.load(weights_only=True) of the same zip bytes
    entry = _current_state()["batch_dict"]["rollout_logprobs"]
    assert entry["format"] == "torch"
    ref = torch.load(io.BytesIO(entry["data"]), weights_only=True)
    assert ref.dtype == torch.bfloat16 and torch.equal(current.batch["rollout_logprobs"], ref[:12])
    # and against the legacy float32 copy, rounded to bfloat16
    bf = _realign_to_legacy(current.batch["rollout_logprobs"].float(), lengths)
    assert torch.equal(bf[resp], legacy.batch["rollout_logprobs"][resp].to(torch.bfloat16).float())


@needs_fixtures
def test_groups_from_boundaries_and_from_prompt_tokens(current, legacy):
    assert current.group_source == "policy_prompt_boundaries" and legacy.group_source == "prompt_tokens"
    assert current.groups == legacy.groups == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert [tuple(a) for a in current.metadata["policy_prompt_boundaries"]] == [(0, 4), (4, 8), (8, 12)]
    for d in (current, legacy):
        for g, rows in enumerate(d.groups):
            assert all(d.prompt_tokens(r) == PROMPTS[g] for r in rows)


@needs_fixtures
def test_per_row_advantages_and_masked_logprob_sums(current, legacy, raw):
    adv_raw = raw["advantages"][:12].double().numpy()
    resp = raw["response_mask"][:12].numpy() == 1
    lp = raw["action_log_probs"][:12].double().numpy()
    lm = raw["loss_mask"][:12].double().numpy()
    ref_adv, ref_sum = [], []
    for k in range(12):
        vals = set(adv_raw[k][resp[k]].tolist())
        assert len(vals) == 1, f"row {k}: one advantage on every response token"
        ref_adv.append(vals.pop())
        ref_sum.append(math.fsum(float(lp[k, j]) for j in range(10) if lm[k, j] == 1.0))
    for d in (current, legacy):
        assert d.advantages_per_row().tolist() == ref_adv
        assert d.masked_logprob_sums().tolist() == pytest.approx(ref_sum, abs=1e-12)
    adv = np.array(ref_adv)
    assert (adv[4:8] == 0).all()  # prompt B: all rewards equal
    for rows in ([0, 1, 2, 3], [8, 9, 10, 11]):  # GRPO: centred within the group, four different values
        assert abs(adv[rows].sum()) < 1e-5 and len(set(adv[rows].tolist())) == 4


@needs_fixtures
def test_row_9_observation_tokens_are_not_trained(current, legacy):
    for d in (current, legacy):
        lm, rm = d.batch["loss_mask"], d.batch["response_mask"].float()
        differs = (lm != rm).nonzero().tolist()
        assert differs == [[9, 3], [9, 4], [9, 5]]
        assert (d.batch["rollout_logprobs"][9, 3:6] == 0).all()
        resp9 = d.response_tokens()[9][rm[9] == 1].tolist()
        assert d.trained_tokens(9) == resp9[:3] + resp9[6:]
        assert d.trained_tokens(9)[-1] == 151645  # EOS


@needs_fixtures
def test_reading_never_imports_skyrl():
    code = (
        "import sys; from lens_callbacks.io import read_skyrl_dump;"
        f"read_skyrl_dump({str(CURRENT)!r}); read_skyrl_dump({str(LEGACY)!r});"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('skyrl', 'skyrl_train')))"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
    assert not [m for m in sys.modules if m.split(".")[0] in ("skyrl", "skyrl_train")]


@needs_fixtures
def test_hostile_dump_is_refused_naming_builtins_eval():
    with pytest.raises(ForbiddenGlobalError) as info:
        read_skyrl_dump(HOSTILE)
    err = info.value
    assert isinstance(err, pickle.UnpicklingError)
    assert (err.module, err.name) == ("builtins", "eval")
    assert "builtins.eval" in str(err) and str(HOSTILE) in str(err)


@needs_fixtures
def test_truncated_dump_is_refused_naming_the_file():
    with pytest.raises(SkyRLDumpError) as info:
        read_skyrl_dump(TRUNCATED)
    assert not isinstance(info.value, ForbiddenGlobalError)
    assert isinstance(info.value, pickle.UnpicklingError) and str(TRUNCATED) in str(info.value)
    assert "truncated" in str(info.value)


def _global(module: str, name: str) -> bytes:
    """A protocol-4 pickle that names one global (STACK_GLOBAL) and calls it with no arguments."""

    def s(x: str) -> bytes:
        b = x.encode()
        return b"\x8c" + bytes([len(b)]) + b

    return b"\x80\x04" + s(module) + s(name) + b"\x93)R."


@pytest.mark.parametrize(
    "module,name",
    [
        ("torch.storage", "_load_from_file"),
        ("torch._utils", "_rebuild_parameter"),
        ("collections", "Counter"),
        ("skyrl_train.training_batch", "os"),
        ("torch", "load"),
        ("builtins", "exec"),
    ],
)
def test_allowed_module_with_another_attribute_is_refused(tmp_path, module, name):
    p = tmp_path / "global_step_0_training_input.pkl"
    p.write_bytes(_global(module, name))
    with pytest.raises(ForbiddenGlobalError, match=rf"{module}\.{name}"):
        read_skyrl_dump(p)
    assert not [m for m in sys.modules if m.split(".")[0] in ("skyrl", "skyrl_train")]


class _Touch:
    """Pickles as ``pathlib.Path.touch(path)``: a visible side effect if anything ever unpickles it for real."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


class _LoadFromBytes:
    """Pickles as ``torch.storage._load_from_bytes(payload)``, as the legacy layout's raw tensor items do."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def __reduce__(self):
        return (torch.storage._load_from_bytes, (self.payload,))


def test_legacy_load_from_bytes_never_runs_the_real_function(tmp_path):
    """The real ``_load_from_bytes`` is ``torch.load(weights_only=False)``: it would run the embedded pickle."""
    marker = tmp_path / "executed"
    inner = io.BytesIO()
    torch.save(_Touch(marker), inner, _use_new_zipfile_serialization=False)  # a legacy torch.save stream
    torch.storage._load_from_bytes(inner.getvalue())  # the real function does execute it ...
    assert marker.exists()
    marker.unlink()
    p = tmp_path / "global_step_0_training_input.pkl"
    p.write_bytes(pickle.dumps({"advantages": _LoadFromBytes(inner.getvalue())}, protocol=4))
    with pytest.raises(SkyRLDumpError):  # ... the reader's stand-in does not, and the file is no batch
        read_skyrl_dump(p)
    assert not marker.exists()


def _np_entry(a: np.ndarray) -> dict:
    return {"format": "numpy", "data": a.tobytes(), "shape": a.shape, "dtype": str(a.dtype)}


def _synthetic(tmp_path, extra=None, response_mask=None) -> Path:
    """A two-row batch as a plain dict state (names no global at all)."""
    seq = np.array([[0, 5, 6, 7], [5, 6, 8, 9]], dtype=np.int64)
    att = np.array([[0, 1, 1, 1], [1, 1, 1, 1]], dtype=np.int64)
    rm = np.array([[0, 1], [1, 1]], dtype=np.int64) if response_mask is None else response_mask
    bd = {
        "sequences": _np_entry(seq),
        "attention_mask": _np_entry(att),
        "response_mask": _np_entry(rm),
        "loss_mask": _np_entry(rm.astype(np.float32)),
        "advantages": _np_entry(rm.astype(np.float32)),
    }
    bd.update(extra or {})
    p = tmp_path / "global_step_7_training_input.pkl"
    p.write_bytes(
        pickle.dumps({"batch_dict": bd, "batch_size": 2, "device": "cpu", "metadata": {"pad_size": 0}}, protocol=4)
    )
    return p


def test_embedded_torch_payloads_are_restricted_too(tmp_path):
    buf = io.BytesIO()
    torch.save(torch.nn.Parameter(torch.zeros(2, 2)), buf)  # names torch._utils._rebuild_parameter
    p = _synthetic(tmp_path, {"values": {"format": "torch", "data": buf.getvalue()}})
    with pytest.raises(ForbiddenGlobalError, match=r"embedded.*_rebuild_parameter"):
        read_skyrl_dump(p)
    p = _synthetic(tmp_path, {"values": {"format": "torch", "data": buf.getvalue()[:100]}})
    with pytest.raises(SkyRLDumpError, match="global_step_7"):
        read_skyrl_dump(p)
    buf = io.BytesIO()
    torch.save(torch.arange(4.0, dtype=torch.float64).view(2, 2).t(), buf)  # a strided view
    d = read_skyrl_dump(_synthetic(tmp_path, {"values": {"format": "torch", "data": buf.getvalue()}}))
    assert torch.equal(d.batch["values"], torch.arange(4.0, dtype=torch.float64).view(2, 2).t())
    assert d.step == 7 and d.layout == "current" and d.groups == [[0, 1]]  # both prompts are [5, 6]
    assert d.prompt_tokens(0) == d.prompt_tokens(1) == [5, 6]


def test_unknown_padding_layout_is_an_error(tmp_path):
    p = _synthetic(tmp_path, response_mask=np.array([[0, 1], [1, 0]], dtype=np.int64))
    with pytest.raises(SkyRLDumpError, match="padding layout"):
        read_skyrl_dump(p)


@needs_fixtures
def test_skyrl_command_prints_the_summary(capsys):
    r = subprocess.run(
        [sys.executable, "-m", "lens_callbacks", "skyrl", str(LEGACY)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "rows 12" in r.stdout and "groups 3" in r.stdout and "advantages" in r.stdout and "layout legacy" in r.stdout
    from lens_callbacks.cli import main

    assert main(["skyrl", str(HOSTILE)]) == 2
    assert "builtins.eval" in capsys.readouterr().err


@needs_fixtures
def test_process_table_of_a_dump(current, legacy, capsys):
    from lens_callbacks.cli import main
    from lens_callbacks.process import audit_groups, groups_from_dump

    groups = groups_from_dump(current)
    assert [len(g.completions) for g in groups] == [4, 4, 4]
    assert groups[2].completions[1] == tuple(current.trained_tokens(9))  # observation tokens left out
    assert list(groups[0].rewards) == current.advantages_per_row()[:4].tolist()
    a = audit_groups(current)
    assert a.numbers() == audit_groups(legacy).numbers()  # same step, either layout
    # the advantage stands in for the popped reward: a positive affine map leaves the table unchanged
    shifted = audit_groups([(g.completions, [2.0 * r + 5.0 for r in g.rewards]) for g in groups])
    for key in ("n_killed", "mean_divergence_depth", "informative_fraction", "zero_reward_fraction"):
        assert shifted.numbers()[key] == pytest.approx(a.numbers()[key]), key
    # the fixture's rollouts never share a first token, so the kill fires everywhere
    assert all(len({c[0] for c in g.completions}) == len(g.completions) for g in groups)
    assert a.n_killed == 3 and a.mean_divergence_depth_range == (1.0, 1.0) and a.informative_fraction_max == 0.0
    assert main(["process", str(CURRENT), "--no-progress"]) == 0
    assert "on 3 of 3" in capsys.readouterr().out


@needs_fixtures
def test_a_dump_cannot_tamper_with_the_stand_ins_of_the_next_read(tmp_path):
    """BUILD may set attributes on what find_class returns; every read gets fresh stand-ins."""

    def s(x: str) -> bytes:
        b = x.encode()
        return b"\x8c" + bytes([len(b)]) + b

    tamper = (
        b"\x80\x04"
        + s("collections")
        + s("OrderedDict")
        + b"\x93"
        + b"N}"
        + s("__init__")
        + s("torch")
        + s("device")
        + b"\x93"
        + b"s\x86b."
    )
    p = tmp_path / "global_step_0_training_input.pkl"
    p.write_bytes(tamper)
    with pytest.raises(SkyRLDumpError, match="applies BUILD .* to the global collections.OrderedDict"):
        read_skyrl_dump(p)
    d = read_skyrl_dump(LEGACY)  # the legacy layout calls the OrderedDict stand-in
    assert d.n_rows == 12 and d.layout == "legacy"
