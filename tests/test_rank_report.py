"""The multi-rank scripts' check reporter (tests/rank_report.py): a failed check on a rank
must make that rank's script exit non-zero, whatever passed after it."""

from rank_report import RankReport


def test_a_failed_check_makes_the_script_exit_non_zero(capsys):
    report = RankReport("rank 1/2")
    report(True, "first")
    report(False, "second", "3 != 4")
    report(True, "third")
    report.summary()
    assert report.status() == 1
    assert capsys.readouterr().out.splitlines() == [
        "rank 1/2 ok first", "rank 1/2 FAIL second: 3 != 4", "rank 1/2 ok third",
        "rank 1/2 1 FAILED"]


def test_a_script_whose_checks_all_passed_exits_zero(capsys):
    report = RankReport("rank 0")
    report(True, "only")
    report.summary()
    assert report.status() == 0 and capsys.readouterr().out.endswith("rank 0 PASSED\n")
