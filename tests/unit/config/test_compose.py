"""Config files that build on others (``extends``): layer order, paths relative to the naming file,
one line for a cycle, a missing base or a bad key with the chain that led to it, where each value
came from, and the shipped 8B variants as short files on one base."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import tomllib

from titan.config import load_config, to_toml
from titan.config.compose import key_lines
from titan.config.manager import _flatten_toml, _set
from titan.errors import TitanError

REPO = Path(__file__).resolve().parents[3]


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _load(path: Path, *cli: str):
    return load_config(["--job.config_file", str(path), *cli])


def test_bases_apply_depth_first_later_values_win_then_the_cli(tmp_path):
    _write(tmp_path, "common/root.toml", "[training]\nsteps = 1\nseq_len = 64\nlocal_batch_size = 2\n")
    # a base's own base is relative to the base, not to the file that named the base
    _write(tmp_path, "common/a.toml", 'extends = "root.toml"\n[training]\nsteps = 2\n[optimizer]\nlr = 0.1\n')
    _write(tmp_path, "b.toml", 'extends = "common/root.toml"\n[optimizer]\nlr = 0.2\n[metrics]\nlog_freq = 3\n')
    top = _write(tmp_path, "top.toml", 'extends = ["common/a.toml", "b.toml"]\n[metrics]\nlog_freq = 4\n')
    config = _load(top, "--training.local_batch_size", "5")
    # root, a, b (root again: applied once, where first reached, so it cannot undo a's steps), top
    assert config.training.steps == 2 and config.training.seq_len == 64
    assert config.optimizer.lr == 0.2 and config.metrics.log_freq == 4
    assert config.training.local_batch_size == 5
    src = config.sources
    assert src["training.steps"] == f"{tmp_path / 'common/a.toml'}:3"
    assert src["training.seq_len"] == f"{tmp_path / 'common/root.toml'}:3"
    assert src["optimizer.lr"] == f"{tmp_path / 'b.toml'}:3" and src["metrics.log_freq"] == f"{top}:3"
    assert src["training.local_batch_size"] == "command line" and "training.max_norm" not in src


def test_a_string_or_a_one_item_list(tmp_path):
    _write(tmp_path, "base.toml", "[training]\nsteps = 9\n")
    one = _write(tmp_path, "one.toml", 'extends = "base.toml"\n')
    listed = _write(tmp_path, "listed.toml", 'extends = ["base.toml"]\n')
    assert _load(one).training.steps == _load(listed).training.steps == 9


def test_a_cycle_is_one_line_with_the_chain(tmp_path):
    _write(tmp_path, "a.toml", 'extends = "b.toml"\n')
    _write(tmp_path, "b.toml", 'extends = "c.toml"\n')
    _write(tmp_path, "c.toml", 'extends = "a.toml"\n')
    a, b, c = (str(tmp_path / n) for n in ("a.toml", "b.toml", "c.toml"))
    with pytest.raises(TitanError) as e:
        _load(tmp_path / "a.toml")
    assert str(e.value) == (
        f"config file '{c}' extends '{a}', which is already in its chain: a cycle ({a} -> {b} -> {c} -> {a})"
    )
    _write(tmp_path, "self.toml", 'extends = "self.toml"\n')
    with pytest.raises(TitanError, match="a cycle"):
        _load(tmp_path / "self.toml")


def test_a_missing_base_names_the_file_and_the_chain(tmp_path):
    _write(tmp_path, "mid.toml", 'extends = "gone.toml"\n')
    top = _write(tmp_path, "top.toml", 'extends = "mid.toml"\n')
    with pytest.raises(TitanError) as e:
        _load(top)
    mid, gone = tmp_path / "mid.toml", tmp_path / "gone.toml"
    assert str(e.value) == (
        f"config file '{mid}' extends '{gone}', which does not exist or is not valid TOML (chain: {top} -> {mid}"
        f" -> {gone}); paths in 'extends' are relative to the file naming them"
    )


def test_a_bad_key_or_value_in_a_base_names_it_and_the_chain(tmp_path):
    base = _write(tmp_path, "base.toml", "[training]\nstepz = 3\n")
    top = _write(tmp_path, "top.toml", 'extends = "base.toml"\n')
    with pytest.raises(TitanError) as e:
        _load(top)
    assert str(e.value).startswith(
        f"config file '{base}' (chain: {top} -> {base}): unknown config key 'training.stepz'"
    )
    assert "did you mean 'training.steps'?" in str(e.value)
    _write(tmp_path, "base.toml", '[training]\nsteps = "many"\n')
    with pytest.raises(TitanError, match=r"\(chain: .*top.toml -> .*base.toml\): config key 'training.steps' got"):
        _load(top)


@pytest.mark.parametrize(
    "text, message",
    [
        ("extends = 3\n", r"'extends' got 3; valid: a path or a list of paths"),
        ('extends = ["a.toml", ""]\n', r"'extends' got \['a.toml', ''\]; valid"),
        (
            '[training]\nsteps = 2\nextends = "a.toml"\n',
            r"'extends' must come first, before any .section. .it is in",
        ),
    ],
)
def test_bad_extends_values(tmp_path, text, message):
    with pytest.raises(TitanError, match=message):
        _load(_write(tmp_path, "x.toml", text))


def test_key_lines_follow_tables_quotes_and_multiline_strings():
    text = (
        'extends = "b.toml"\n'
        "[job]\n"
        'description = """two\nlines = not a key\n"""\n'
        '"dump_folder" = "x"  # quoted\n'
        "[[training.mixture]]\n"
        'dataset = "c4"\n'
        "  [ training ]\n"
        "steps=3\n"
    )
    lines = key_lines(text)
    assert lines["extends"] == 1 and lines["job.description"] == 3 and lines["job.dump_folder"] == 6
    assert "job.lines" not in lines and lines["training.mixture"] == 7 and lines["training.steps"] == 10


def test_print_config_sources_shows_each_value_and_loads_back(tmp_path, capsys, monkeypatch):
    _write(tmp_path, "base.toml", "[training]\nsteps = 11\n\n[metrics]\nlog_freq = 2\n")
    top = _write(tmp_path, "top.toml", 'extends = "base.toml"\n\n[metrics]\nlog_freq = 3\n')
    config = _load(top, "--optimizer.lr", "0.01")
    text = to_toml(config, sources=True)
    assert f"steps = 11  # {tmp_path / 'base.toml'}:2\n" in text and f"log_freq = 3  # {top}:4\n" in text
    assert "lr = 0.01  # command line\n" in text and "max_norm = 1.0  # default\n" in text
    again = load_config([])  # the text is TOML for the same config
    for key, value in _flatten_toml(tomllib.loads(text), "printed"):
        _set(again, key, value, from_cli=False)
    assert dataclasses.replace(again, job=dataclasses.replace(again.job, config_file=str(top))) == config
    # as users see it: train.py prints it first (here before a dry run, not run: its own tests do)
    import titan.tools.dry_run
    from titan.launch.entry import main

    monkeypatch.setattr(titan.tools.dry_run, "main", lambda config: 0)
    assert main(["--job.config_file", str(top), "--job.print_config_sources", "--job.dry_run"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# titan: merged config") and f"log_freq = 3  # {top}:4\n" in printed


def test_torchtitan_files_keep_their_spelling_per_layer(tmp_path):
    """A torchtitan file can be a base: its nested tables are translated before the layers merge."""
    _write(tmp_path, "tt.toml", '[training]\nsteps = 4\n[quantize.linear.float8]\nfilter_fqns = ["output", "x"]\n')
    top = _write(tmp_path, "top.toml", 'extends = "tt.toml"\n[training]\nsteps = 5\n')
    config = _load(top)
    assert config.training.steps == 5 and config.float8.filter_fqns == ["output", "x"]
    assert config.sources["float8.filter_fqns"] == f"{tmp_path / 'tt.toml'} (torchtitan spelling)"


def test_the_configs_page_shows_what_print_config_sources_prints(monkeypatch):
    monkeypatch.chdir(REPO)  # the page's paths are relative to the repository
    printed = to_toml(_load(Path("train_configs/llama3_8b_long_context.toml")), sources=True).splitlines()
    page = (REPO / "docs/configs.md").read_text()
    shown = [line for line in page.splitlines() if "  # train_configs/" in line]
    assert len(shown) >= 4 and all(line in printed for line in shown), [s for s in shown if s not in printed]
