"""specdec-analyze: why acceptance is what it is, from the files specdec-run wrote.

    specdec-analyze outputs/2026-01-01/12-00-00          # one run: report.md + PNGs into the run dir
    specdec-analyze multirun/2026-01-01/12-00-00         # a sweep: every run below it, compared
    specdec-analyze RUN_A SWEEP_B --out comparison/      # several inputs need --out
    specdec-analyze RUN/wandb/offline-run-...            # a W&B offline run (see below)

Each run contributes results.json, steps.jsonl and prompts.jsonl, and .hydra/overrides.yaml when
Hydra wrote one: runs are labelled by the overrides that differ between them. The report states
tau per workload category, the per-depth conditional acceptance alpha_d, the survival curve
P(accepted drafts >= d), the sibling rank of accepted nodes, tau along the output, the split of
speculative time, and the measured speedup beside the analytic one

    S = tau * T(1) / (T(n) + T_draft)

where T(1) is the baseline's mean target forward, T(n) the speculative side's mean target forward
over its trees and T_draft its mean drafting time per step, all measured in the same run. The model
leaves out prefill, verification and the loop's own cost (the "overhead share", other / total, as
results.json defines it); on both sides of the comparison, so a gap can go either way.

A W&B offline run (wandb/offline-run-*) inside a specdec-run run dir is analysed through that run
dir. A W&B run on its own (copied without the run's files) is read through wandb's own reader of its
run-*.wandb log (``wandb leet inspect --json``): the run's summary and overrides, but no per-step
rows, so the category, position and prompt length analyses leave it out. With --wandb (the default when a W&B run is given) the tables and
plots also go to a new offline W&B run in the output dir.

The package, in the order the command uses it:

- ``errors``: ``AnalyzeError``, bad input, which the command reports in one line (exit status 2).
- ``discover``: finding run dirs, sweep dirs and W&B runs; reading results.json, prompts.jsonl,
  steps.jsonl and the Hydra overrides into ``RunFiles``, and refusing what is not one finished run.
- ``wandb_log``: a W&B offline run's name, group, config, summary and tables, read through wandb's
  own reader of its transaction log.
- ``findings``: ``RunAnalysis`` (``analyze_run``), each run's label, and the findings, one sentence each.
- ``tables``: the report's markdown tables.
- ``report``: the plots, report.md and the offline W&B run of the analysis.
- ``command``: ``analyze()`` and ``main()``, the specdec-analyze command line.

The plots, the run dir's file list and the units.jsonl records it shares with specdec-run are in
experiments.common.
"""

from experiments.analyze.command import main

__all__ = ["main"]
