"""The command's entry points: ``python -m shmkv`` wherever it is run from, and a mistyped
option reported by the command it was given to."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shmkv.cli import main


def test_python_m_shmkv_next_to_a_folder_named_shmkv(tmp_path):
    """From a folder holding a checkout named ``shmkv`` (no ``__init__.py`` at its top),
    ``python -m shmkv`` and ``python -m shmkv.cli`` run the installed command."""
    (tmp_path / "shmkv").mkdir()
    (tmp_path / "shmkv" / "README.md").write_text("a checkout\n")
    for module in ("shmkv", "shmkv.cli"):
        done = subprocess.run([sys.executable, "-m", module, "--version"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stderr) == (0, ""), module
        assert done.stdout.startswith("shmkv 0.1.0 (layout v"), module


def test_mistyped_option_prints_the_commands_usage(capsys):
    """``shmkv cleanup --prefx P`` prints cleanup's usage and the option it is close to,
    not the top-level usage; an unknown option before the command is the top level's."""
    with pytest.raises(SystemExit) as exc:
        main(["cleanup", "--prefx", "p"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.startswith("usage: shmkv cleanup [-h]")
    assert err.splitlines()[-1] == ("shmkv cleanup: error: unrecognized arguments: --prefx p "
                                    "(did you mean --prefix?)")
    with pytest.raises(SystemExit) as exc:
        main(["--bogus", "ls"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("usage: shmkv [-h]")
    assert err.splitlines()[-1] == "shmkv: error: unrecognized arguments: --bogus"
