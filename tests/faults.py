"""What the fault-injection tests share: the kill they inject."""


class Crash(BaseException):
    """A kill: raised where a test says, caught by nothing under test (no ``except Exception``), so
    nothing after it runs, as after SIGKILL."""
