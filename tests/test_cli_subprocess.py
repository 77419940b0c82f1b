"""Issue 17, item 7: bad input at the command line, through real `kvpack ...` processes: one line
naming the problem on stderr, a non-zero exit, no traceback unless --debug. (Cases that need the
packaged model are in test_kvtc_smollm2.py.)"""

from __future__ import annotations

import pytest

from .helpers import run_kvpack

pytestmark = pytest.mark.slow  # each process imports torch and transformers (~5 s)


@pytest.mark.parametrize("args,message", [
    (["generate", "--prompt", ""], "empty prompt"),
    (["generate", "--method", "kvtc", "--set", "level=15", "--prompt", "hi"], "level must be <= 9 for zlib"),
    (["compress", "--calibration", "nowhere", "--ratio", "16", "--level", "99", "--prompt", "hi", "--out", "x.kvtc"],
     "level must be <= 22, got 99"),
    (["generate", "--method", "puzzle", "--budget", "2", "--prompt", "hi"], "budget must be in (0, 1]"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path):
    run = run_kvpack(args, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert not (tmp_path / "x.kvtc").exists()


def test_debug_shows_the_traceback(tmp_path):
    run = run_kvpack(["--debug", "generate", "--prompt", ""], cwd=tmp_path)
    assert run.returncode != 0 and "Traceback" in run.stderr and "empty prompt" in run.stderr
