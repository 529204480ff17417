"""What specdec-run, specdec-analyze, specdec-bench and specdec-train share, so that none of them
imports another's package: run and analyze both import from here and never from each other, and an
orchestrator such as bench may use both (tests/test_import_direction.py holds it). Nothing here
imports another experiments package (experiments.cli, the shared command-line helpers, aside).

- ``sinks``: where a run's metrics go while it runs (``SINKS``, ``make_sink``, ``LoggerConfig``).
- ``outputs``: a run dir's files (``RUN_OUTPUTS``), each written complete or not at all.
- ``records``: the per-unit records (units.jsonl) and every interval computed from them.
- ``plots``: the PNG renderers of a run, its analysis and the leaderboard.
- ``formatting``: a figure with its interval, a markdown table.
"""
