"""What a multi-rank test script prints for each check, and its exit status.

The scripts under tests/ run under mpiexec; the pytest side reads their output. A check
prints "<label> ok|FAIL <what>[: <detail>]" on its rank and counts a failure; the script
ends with summary() and exits with status(), so a failed check on any rank makes the job
exit non-zero. (A script runs as a file, python tests/ops/x.py: it puts tests/ on sys.path
before importing this.)"""


class RankReport:
    def __init__(self, label: str):
        self.label = label  # "rank 3" or "rank 3/4": what the pytest side matches
        self.failures = 0

    def __call__(self, ok: bool, what: str, detail: str = "") -> bool:
        self.failures += not ok
        tail = f": {detail}" if detail else ""
        print(f"{self.label} {'ok' if ok else 'FAIL'} {what}{tail}", flush=True)
        return bool(ok)

    def raises_everywhere(self, call, named, raised: str, then, after: str) -> None:
        """Check `call()` raises a RocmoeError whose text `named(text)` accepts (a bad rank
        its own error, the others one naming that rank), reported as `raised`; then that
        `then()`, the next step, works, reported as `after`."""
        from rocmoe import RocmoeError
        try:
            call()
        except RocmoeError as exc:
            self(named(str(exc)), raised, str(exc)[:200])
        except Exception as exc:  # noqa: BLE001 - any other outcome is a failure to report
            self(False, raised, repr(exc)[:200])
        else:
            self(False, raised, "no error")
        try:
            then()
            self(True, after)
        except Exception as exc:  # noqa: BLE001
            self(False, after, repr(exc)[:200])

    def summary(self) -> None:
        """The closing line: PASSED, or how many checks failed on this rank."""
        verdict = "PASSED" if self.failures == 0 else f"{self.failures} FAILED"
        print(f"{self.label} {verdict}", flush=True)

    def status(self) -> int:
        return 1 if self.failures else 0
