"""Is our plain decoding as fast as transformers' ``generate()`` on this machine? Checked before the
timed passes, so that no speedup is reported against a baseline a user would not pick.

Our baseline is plain decoding through the speculative loop (an empty tree each step). A speedup
over it overstates the gain a user sees wherever transformers' own ``generate()`` on a stock load of
the same model decodes faster. So a run on a Hugging Face target at batch 1 times the two on its
first ``CHECK_PROMPTS`` prompts, ``baseline_check_tokens`` tokens each, in ``CHECK_ROUNDS`` rounds
whose order alternates, after an untimed call of each on each prompt. When ``generate()`` is faster
by its interval (paired over the prompts), it joins the timed passes as the peer ``hf_generate`` and
the run's headline speedup is against it (``headline``); either way results.json records both rates.
"""

from __future__ import annotations

from typing import Any

from experiments.common import records
from experiments.common.records import BASELINE
from experiments.run.measure import Plan, Request, Side, decode, turns
from specdec.intervals import rate_ratio_interval

GENERATE = "hf_generate"  # the peer's name and its side's label (experiments.run.peers)
CHECK_PROMPTS = 4
CHECK_ROUNDS = 2


def check_baseline(requests: list[Request], baseline: Side, generate: Side, plan: Plan, tokens: int) -> dict[str, Any]:
    """generate()'s tokens/s over ours on the first prompts, with its paired interval; ``tokens`` is
    capped at the run's answer length, which the prompts were checked against."""
    chosen, tokens = requests[:CHECK_PROMPTS], min(tokens, plan.max_new_tokens)
    sides = {BASELINE: baseline, GENERATE: generate}
    for request in chosen:  # each meets every prompt length once, untimed
        for side in sides.values():
            decode(side, [request], plan, min(tokens, 8))
    totals = {name: ([0] * len(chosen), [0.0] * len(chosen)) for name in sides}  # tokens, seconds per prompt
    for round_ in range(CHECK_ROUNDS):
        for index, request in enumerate(chosen):
            for name in turns(list(sides), index, round_):
                timed = decode(sides[name], [request], plan, tokens)
                totals[name][0][index] += sum(len(o) for o in timed.decoded.outputs)
                totals[name][1][index] += timed.wall_s
    interval = rate_ratio_interval(*totals[GENERATE], *totals[BASELINE], seed=plan.seed)
    rate = {name: sum(tokens_) / max(sum(seconds), 1e-12) for name, (tokens_, seconds) in totals.items()}
    ratio = rate[GENERATE] / rate[BASELINE]
    return {
        "prompts": len(chosen),
        "tokens": tokens,
        "rounds": CHECK_ROUNDS,
        "tokens_per_s": rate[BASELINE],
        "tokens_per_s_generate": rate[GENERATE],
        "generate_over_ours": ratio,
        "generate_over_ours_interval": interval.as_list() if interval else None,
        # generate() faster beyond the interval: our baseline would flatter every speedup
        "ours_slower": bool(interval and interval.excludes(1.0) and ratio > 1),
    }


def headline(results: dict[str, Any], rows: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    """The speedup a run leads with: over our plain decoding, or over generate() where that was the
    faster plain decoder in the timed passes (its speedup over ours excludes 1 from above)."""
    peer = next((side for side in results.get("peers", []) if side["drafter"] == GENERATE), None)
    generate_faster = (peer is not None and peer["speedup_interval"] is not None
                       and peer["speedup_interval"][0] > 1)
    if not generate_faster:
        return {"against": BASELINE, "speedup": results["speedup"], "speedup_interval": results["speedup_interval"]}
    interval = records.speedup_interval(rows, records.SPECULATIVE, GENERATE, seed)
    return {
        "against": GENERATE,
        "speedup": interval.estimate if interval else 1 / peer["ratio_to_drafter"],
        "speedup_interval": interval.as_list() if interval else None,
    }
