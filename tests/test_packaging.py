"""Packaging and the ``kvroute`` command: what a user gets from ``pip install .`` / ``pip install -e .``."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import venv
from importlib.metadata import version
from pathlib import Path

import pytest
from kvroute.launch import cli

ROOT = Path(__file__).resolve().parents[1]


def test_version_comes_from_the_installed_metadata(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvroute {version('kvroute')}"


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for words in cli.COMMANDS:
        assert " ".join(words) in out


def test_unknown_command_exits_2_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["no-such-command"]) == 2
    assert "unknown command 'no-such-command'" in capsys.readouterr().err


@pytest.mark.parametrize("words", list(cli.COMMANDS))
def test_every_command_module_exists_and_has_main(words: tuple[str, ...]) -> None:
    module = importlib.import_module(cli.COMMANDS[words][0])
    assert callable(module.main)


def test_each_command_answers_help() -> None:
    for words in cli.COMMANDS:
        proc = subprocess.run(
            [sys.executable, "-m", "kvroute.launch.cli", *words, "--help"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, (words, proc.stderr[-2000:])
        assert "usage" in proc.stdout.lower()


def _tracked_copy(dest: Path) -> Path:
    """The repository as git tracks it, so a build here never touches the working tree's .so files."""
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.mark.slow
@pytest.mark.parametrize("editable", [False, True], ids=["regular", "editable"])
def test_fresh_venv_install_gives_import_and_console_command(tmp_path: Path, editable: bool) -> None:
    if not (ROOT / ".git").exists():
        pytest.fail("tests must run from a git checkout of kvroute")
    src = _tracked_copy(tmp_path / "src")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    # numpy is the one runtime import of the cache core; the rest of the dependencies are not needed
    # to prove the layout, and skipping them keeps this test fast and offline-friendly
    target = ["-e", str(src)] if editable else [str(src)]
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", *target], check=True, timeout=900)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "numpy"], check=True, timeout=600)
    probe = (
        "import kvroute.cache as c; "
        "r = c.RadixCache(16, policy='rlt', seed=1); r.insert([1, 2, 3]); "
        "print(r.match_prefix([1, 2, 3])[0], c.__file__)"
    )
    out = subprocess.run(
        [str(py), "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0] == "3"
    # an editable install maps kvroute.cache onto the source folder; a regular one onto site-packages
    assert (str(src) in out[1]) == editable
    cmd = subprocess.run(
        [str(env_dir / "bin" / "kvroute"), "--version"], capture_output=True, text=True, check=True
    )
    assert cmd.stdout.strip() == f"kvroute {version('kvroute')}"
