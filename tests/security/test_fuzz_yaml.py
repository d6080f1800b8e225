"""Family "broken YAML": `anchor-arms --config` on configs that are not YAML, name Python objects, link to the
kernel's files, or expand to billions of nodes.

Each once ended in a traceback, exit 1 (the alias bomb after 5.9 GB). Now the config is read bounded
(:mod:`lens_callbacks.io.config`): one line naming the config (and the line and column, quoting none of its
lines), exit 2, within 600 MB and 10 s, and no marker file from a `!!python` tag. `--out` is a regular file
in every case, so a config that does read cannot start a run: its first run directory cannot be made.
"""

from __future__ import annotations

import os
from pathlib import Path

import file_families as F
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FUZZ = settings(
    max_examples=150 if F.LONG else 15,
    deadline=None,
    derandomize=not F.LONG,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "cli_configs").glob("*.yaml"))


def _arms(w, cfg: Path, tmp: Path):
    out = tmp / "out_is_a_file"
    out.write_text("")
    return w.run(
        "anchor-arms",
        "--config",
        cfg,
        "--steps",
        "1",
        "--arms",
        "A",
        "--seeds",
        "1",
        "--no-parity",
        "--no-progress",
        "--out",
        out,
        timeout=60,
        mem_mb=2048,
        cwd=tmp,
    )


def _check(r, cfg: Path, marker: Path = None, read: bool = False):
    if r.rc == 2 and str(cfg) not in r.stderr and read:  # it read: refused at the run directory (or a later check)
        return F.refused(r, "broken YAML", "out_is_a_file", marker=marker)
    return F.refused(r, "broken YAML", str(cfg), marker=marker)


@FUZZ
@given(
    which=st.integers(0, 100),
    cut=st.floats(0, 1),
    flips=st.lists(
        st.tuples(
            st.floats(0, 1, exclude_max=True), st.sampled_from(list(b":-[]{}&*!|>'\"%@`\t\n #?,") + [0, 0xFF, 0xC3])
        ),
        max_size=6,
    ),
)
def test_mutated_configs(families_worker, tmp_path_factory, which, cut, flips):
    tmp = tmp_path_factory.mktemp("yaml")
    data = bytearray(CONFIGS[which % len(CONFIGS)].read_bytes() if CONFIGS else F.CONFIG.encode())
    for where, byte in flips:
        data[int(where * len(data))] = byte if isinstance(byte, int) else ord(byte)
    data = data[: max(1, int(cut * len(data)))]
    cfg = tmp / "config.yaml"
    cfg.write_bytes(bytes(data))
    _check(_arms(families_worker, cfg, tmp), cfg, read=True)


@pytest.mark.parametrize("kind", ["apply", "new", "name"])
def test_python_tags_run_nothing(families_worker, tmp_path, kind):
    marker = tmp_path / "MARKER"
    cfg = tmp_path / "config.yaml"
    cfg.write_text(F.CONFIG + F.python_tag(marker, kind).replace("model:", "extra:"))
    line = _check(_arms(families_worker, cfg, tmp_path), cfg, marker)
    assert "line" in line and "column" in line and "python" in line  # the tag, where it is; none of the file's lines


@pytest.mark.parametrize("target", ["/proc/self/pagemap", "/proc/self/mem", "/dev/zero", "fifo", "directory", "sparse"])
def test_unreadable_configs_are_one_line(families_worker, tmp_path, target):
    cfg = tmp_path / "config.yaml"
    if target == "fifo":
        os.mkfifo(cfg)
    elif target == "directory":
        cfg.mkdir()
    elif target == "sparse":
        F.sparse(cfg, 2 * F.GiB - 1, F.CONFIG.encode())
    else:
        os.symlink(target, cfg)
    _check(_arms(families_worker, cfg, tmp_path), cfg)


@FUZZ
@given(levels=st.integers(1, 400 if F.LONG else 40), fan=st.integers(2, 9), recursive=st.booleans())
def test_alias_bombs(families_worker, tmp_path_factory, levels, fan, recursive):
    tmp = tmp_path_factory.mktemp("bomb")
    cfg = tmp / "config.yaml"
    text = F.alias_bomb(levels, fan)
    if recursive:
        text += "loop: &loop [*loop]\n"
    cfg.write_text(text)
    r = _arms(families_worker, cfg, tmp)
    if recursive or fan**levels > 200_000:
        line = F.refused(r, "broken YAML", str(cfg))
        assert "alias" in line, line
    else:
        _check(r, cfg, read=True)


def test_alias_bomb_cost_scales_linearly(families_worker, tmp_path_factory):
    def run(levels):
        tmp = tmp_path_factory.mktemp("bomb")
        cfg = tmp / "config.yaml"
        cfg.write_text(F.alias_bomb(levels, 9) + "".join(f"k{i}: [{i}, {i}]\n" for i in range(20 * levels)))
        return _arms(families_worker, cfg, tmp)

    F.assert_scales("broken YAML", run, [100, 200, 400] + ([800] if F.LONG else []), tiny=1)


def test_a_key_that_is_not_an_option_name_is_one_line(tmp_path):
    # what the long-mode fuzz found: a flipped byte turned a key into `null` beside string keys, and
    # `anchor-arms` crashed sorting them (exit 71); the reader now refuses it by name
    from lens_callbacks.io.config import read_config_yaml

    for text in ("a: 1\n~: 2\n", "trainer:\n  max_steps: 3\n  3: x\n"):
        f = tmp_path / "c.yaml"
        f.write_text(text)
        with pytest.raises(ValueError) as err:
            read_config_yaml(f)
        assert "\n" not in str(err.value) and "must be an option name" in str(err.value)
    (tmp_path / "ok.yaml").write_text("a: &x {b: 1}\nc: *x\n")
    assert read_config_yaml(tmp_path / "ok.yaml") == {"a": {"b": 1}, "c": {"b": 1}}
