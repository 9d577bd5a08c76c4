"""Config loading: valid files, overrides, and one clear line for every kind of bad input."""

import subprocess
import sys

from tests.unit.test_config import GOOD, write


def test_cli_exit_status_and_no_traceback(tmp_path):
    """The real command, as a user runs it: status 2 and a single line on stderr."""
    path = write(tmp_path, GOOD + "lr_scheduler = 'cosine'\n")
    proc = subprocess.run(
        [sys.executable, "-m", "scaleout.cli", "train", str(path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "train.lr_scheduler: unknown key" in proc.stderr
