"""scripts/replay_test_schedule.py: pytest-xdist's ``--dist loadfile`` replayed from a run's
``REVTRAIN_TEST_CPU`` records (in this process, milliseconds)."""

import importlib.util
import json

from conftest import LONGEST_FIRST
from helpers import REPO

_SPEC = importlib.util.spec_from_file_location("replay_test_schedule", REPO / "scripts" / "replay_test_schedule.py")
replay_test_schedule = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(replay_test_schedule)


def test_a_worker_takes_the_next_file_when_two_of_its_tests_are_left():
    """Worked by hand: gw0 takes a (3 tests of 4 s), gw1 takes b (1 s) and at once c too (its 1 test left);
    gw1 takes d when b ends at 1 s (c's one test left); gw0 never has 2 or fewer left while a file waits."""
    ends, files = replay_test_schedule.replay([("a", [4, 4, 4]), ("b", [1]), ("c", [6]), ("d", [2, 2])], 2)
    assert ends == [12, 11]
    assert files == [[("a", 0)], [("b", 0), ("c", 0), ("d", 1)]]


def test_files_go_in_conftests_order():
    """`LONGEST_FIRST` first, in its order; the other files by name."""
    names = ["test_zzz.py", LONGEST_FIRST[1], "test_aaa.py", LONGEST_FIRST[0]]
    assert replay_test_schedule.collection_order(names) == [LONGEST_FIRST[0], LONGEST_FIRST[1], "test_aaa.py",
                                                            "test_zzz.py"]


def test_a_run_with_wall_times_is_read_back_as_it_went(tmp_path, capsys):
    """Records with ``worker``, ``start`` and ``wall_s``: the replay's ends, and each worker's span and its
    wait for the last test to end."""
    rows = [("tests/test_x.py::a", 3.0, 3.5, 100.0, "gw0"), ("tests/test_y.py::b", 1.0, 1.5, 100.0, "gw1"),
            ("tests/test_x.py::c", 2.0, 2.5, 103.5, "gw0")]
    path = tmp_path / "cpu.jsonl"
    path.write_text("".join(json.dumps({"test": t, "cpu_s": c, "wall_s": w, "start": s, "worker": k}) + "\n"
                            for t, c, w, s, k in rows))
    assert replay_test_schedule.main([str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "replay of 3 tests in 2 files, cpu_s: 6.0 s in all"
    assert out[3] == "  balanced end 3.0 s; last end 5.0 s; tail 4.0 s"
    assert out[5] == "  gw0: 2 tests, 5.0 CPU s, 6.0 s of tests from 0.0 to 6.0 s; idle at the end 0.0 s"
    assert out[6] == "  gw1: 1 tests, 1.0 CPU s, 1.5 s of tests from 0.0 to 1.5 s; idle at the end 4.5 s"
