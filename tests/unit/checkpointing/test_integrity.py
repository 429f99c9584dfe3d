"""A committed checkpoint whose files were damaged afterwards: truncated .distcp,
empty / missing / garbage .metadata, 1 flipped bit, 3 x 64 flipped bytes. Each is found by the
manifest check, skipped with one warning naming the file and the problem, and the intact older
checkpoint is loaded, the run then going on exactly like the uninterrupted one."""

import json
import logging
import random
import shutil
from pathlib import Path

import pytest

from tests.helpers.runs import train_subprocess
from titan.checkpointing.manifest import MANIFEST, verify
from titan.checkpointing.resume import choose_intact
from titan.errors import TitanError


def _truncate(p: Path, name: str = "__0_0.distcp") -> None:
    data = (p / name).read_bytes()
    (p / name).write_bytes(data[: len(data) // 2])


def _flip(p: Path, n: int, width: int, bits: bool) -> None:
    f = p / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    rng = random.Random(0)
    for _ in range(n):
        at = rng.randrange(len(data) // 4, len(data) - width)  # inside the tensors, past the zip header
        for i in range(width):
            data[at + i] ^= 1 if bits else 0xFF
    f.write_bytes(bytes(data))


def _garbage(f: Path) -> None:
    rng = random.Random(1)
    f.write_bytes(bytes(rng.randrange(256) for _ in range(f.stat().st_size)))


DAMAGE = {
    "truncated distcp": (_truncate, "__0_0.distcp is", "(truncated)"),
    "empty metadata": (lambda p: (p / ".metadata").write_bytes(b""), ".metadata is 0 bytes", "(empty)"),
    "missing metadata": (lambda p: (p / ".metadata").unlink(), ".metadata is missing", ""),
    "garbage metadata": (
        lambda p: _garbage(p / ".metadata"),
        ".metadata has the right size but different bytes",
        "checksum",
    ),
    "one flipped bit": (lambda p: _flip(p, 1, 1, True), "__0_0.distcp has the right size", "checksum"),
    "3 x 64 flipped bytes": (lambda p: _flip(p, 3, 64, False), "__0_0.distcp has the right size", "checksum"),
    # the per-rank file is committed with the DCP files: torn or lost, the checkpoint is damaged
    "truncated rank file": (lambda p: _truncate(p, "rank_0.pt"), "rank_0.pt is", "(truncated)"),
    "missing rank file": (lambda p: (p / "rank_0.pt").unlink(), "rank_0.pt is missing", ""),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One uninterrupted 6-step run with checkpoints at 2, 4, 6 (made once)."""
    folder = tmp_path_factory.mktemp("ref")
    rc, text, losses = train_subprocess(folder, "--training.steps", "6", "--checkpoint.interval", "2")
    assert rc == 0, text[-3000:]
    return folder, losses


def _damaged_copy(saved_folder: Path, dst: Path, damage) -> Path:
    root = dst / "checkpoint"
    root.mkdir(parents=True)
    for step in (2, 4):
        shutil.copytree(saved_folder / f"checkpoint/step-{step}", root / f"step-{step}")
    damage(root / "step-4")
    return root


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_newest_falls_back_to_intact_older(saved, tmp_path, case, caplog):
    folder, _ = saved
    damage, *needles = DAMAGE[case]
    root = _damaged_copy(folder, tmp_path, damage)
    assert verify(str(root / "step-2")) is None
    with caplog.at_level(logging.WARNING, logger="titan"):
        found = choose_intact(str(root), -1)
    assert found.step == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert str(root / "step-4") in warnings[0] and all(n in warnings[0] for n in needles), warnings[0]
    assert "--checkpoint.load_step" in warnings[0]
    with pytest.raises(TitanError, match=r"load_step 4: .*step-4 is damaged.*--checkpoint.load_step N"):
        choose_intact(str(root), 4)


@pytest.mark.slow
def test_flipped_bytes_resume_from_older_exactly(saved, tmp_path):
    """End to end: the run skips the damaged step-4 with one warning, resumes from step-2 and its
    losses equal the uninterrupted run's; the next save replaces the damaged folder."""
    folder, ref = saved
    root = _damaged_copy(folder, tmp_path, DAMAGE["3 x 64 flipped bytes"][0])
    rc, text, losses = train_subprocess(tmp_path, "--training.steps", "6", "--checkpoint.interval", "2")
    assert rc == 0, text[-3000:]
    assert text.count("is damaged") == 1 and "resumed from" in text and "step-2: step 2" in text, text[-3000:]
    assert losses == {s: ref[s] for s in range(3, 7)}
    assert verify(str(root / "step-4")) is None


@pytest.mark.slow
def test_manifest_lists_every_file_and_all_damaged_is_an_error(saved, tmp_path):
    folder, _ = saved
    step = folder / "checkpoint/step-6"

    listed = set(json.loads((step / MANIFEST).read_text())["files"])
    assert listed == {".metadata", "__0_0.distcp", "config.json", "rank_0.pt"}
    root = tmp_path / "checkpoint"
    root.mkdir()
    shutil.copytree(step, root / "step-6")
    (root / "step-6/.metadata").unlink()
    with pytest.raises(TitanError, match=r"no intact checkpoint .*--job.overwrite"):
        choose_intact(str(root), -1)
