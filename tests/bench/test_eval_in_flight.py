"""bench/eval_in_flight.py refuses a run the store does not hold in one line, exit status 2."""

from __future__ import annotations

import pytest

from bench import eval_in_flight


def test_an_unknown_run_is_one_line_and_exit_status_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path))
    monkeypatch.delenv("RLPIPE_STORE__ROOT", raising=False)
    with pytest.raises(SystemExit) as exc:
        eval_in_flight.main(["--run", "nosuch"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no run 'nosuch'" in err
