"""The one error specdec-analyze reports for bad input, shared by every module of the package."""


class AnalyzeError(Exception):
    """Bad input: reported as one line without a traceback, exit status 2."""
