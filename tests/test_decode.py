"""The decode loop on the synthetic target: greedy equality, batch independence, stopping, stats."""

from __future__ import annotations

import pytest
import torch

from drafters.synthetic import SyntheticDrafter
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.synthetic import NO_TOKEN, SyntheticTarget
from specdec.tree import SiblingMode
from verifiers import reference

GREEDY = SamplingParams(0.0)
SHAPES = [((1,), "sampled_iid"), ((1, 1, 1, 1), "sampled_iid"), ((2, 2), "sampled_iid"),
          ((3, 2), "sampled_wor"), ((2, 2, 2), "deterministic"), ((4,), "deterministic")]


def argmax_decode(target: SyntheticTarget, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        context = torch.tensor([([NO_TOKEN] * target.order + seq)[-target.order :]])
        seq.append(int(target.logits(context, torch.tensor([len(seq)])).argmax(-1)))
    return seq[len(prompt) :]


@pytest.mark.parametrize("branching,mode", SHAPES)
@pytest.mark.parametrize("divergence", [0.0, 0.6, 1.0])
def test_greedy_output_equals_argmax_decoding(branching, mode, divergence):
    target = SyntheticTarget(vocab_size=16, sharpness=2.0, seed=3)
    drafter = SyntheticDrafter(target, branching, mode, divergence)
    prompts = [[1], [2, 3, 4], [5, 6], [7] * 9]
    out = SpecDecoder(target, drafter, reference.verify).generate(prompts, 23, GREEDY, seed=4)
    for prompt, generated in zip(prompts, out.outputs):
        assert generated == argmax_decode(target, prompt, 23)
    if divergence == 0.0:  # q = p: every draft is accepted, tau is the full depth + 1
        assert out.stats.per_depth_alpha[0] == 1.0


def test_plain_decoding_is_the_same_loop_with_no_drafter():
    target = SyntheticTarget(vocab_size=16, sharpness=2.0)
    out = SpecDecoder(target, None, reference.verify).generate([[1, 2]], 10, GREEDY)
    assert out.outputs[0] == argmax_decode(target, [1, 2], 10)
    assert out.stats.tau == 1.0 and out.stats.num_steps == 10


@pytest.mark.parametrize("mode", ["sampled_iid", "sampled_wor", "deterministic"])
def test_a_request_output_does_not_depend_on_its_batch_neighbours(mode):
    target = SyntheticTarget(vocab_size=12, sharpness=1.0)
    drafter = SyntheticDrafter(target, (2, 2), mode, 0.5)
    decoder = SpecDecoder(target, drafter, reference.verify)
    sampling = SamplingParams(1.0, top_p=0.9)
    prompts = {"a": [1, 2, 3], "b": [4], "c": [5, 6], "d": [7, 8, 9, 10]}
    seeds = {"a": 11, "b": 12, "c": 13, "d": 14}

    def run(names):
        out = decoder.generate([prompts[n] for n in names], 15, sampling, seeds=[seeds[n] for n in names])
        return dict(zip(names, out.outputs))

    alone = run(["c"])
    mixed = run(["a", "b", "c", "d"])
    reordered = run(["d", "c", "a"])
    assert alone["c"] == mixed["c"] == reordered["c"]
    assert mixed["a"] == reordered["a"] and mixed["d"] == reordered["d"]
    assert mixed["a"] != mixed["d"]  # sampling is live: different seeds give different text


def test_same_seed_same_output_and_another_seed_differs():
    target = SyntheticTarget(vocab_size=12)
    decoder = SpecDecoder(target, SyntheticDrafter(target, (1, 1)), reference.verify)
    run = lambda seed: decoder.generate([[1, 2]] * 4, 20, SamplingParams(1.0), seed=seed).outputs
    assert run(5) == run(5)
    assert run(5) != run(6)


def test_eos_stops_a_request_and_is_kept():
    target = SyntheticTarget(vocab_size=16, sharpness=2.0, seed=3)
    reference_text = argmax_decode(target, [1], 30)
    eos = reference_text[7]
    first = reference_text.index(eos)
    drafter = SyntheticDrafter(target, (1, 1, 1), "deterministic", 0.3)
    out = SpecDecoder(target, drafter, reference.verify).generate(
        [[1], [1]], 30, GREEDY, eos_token_id=eos
    )
    assert out.outputs[0] == reference_text[: first + 1] == out.outputs[1]


def test_max_new_tokens_is_exact_even_when_a_step_could_overshoot():
    target = SyntheticTarget(vocab_size=8)
    drafter = SyntheticDrafter(target, (1,) * 6, "sampled_iid", 0.0)  # accepts everything
    out = SpecDecoder(target, drafter, reference.verify).generate([[1]] * 3, 10, SamplingParams(1.0))
    assert [len(o) for o in out.outputs] == [10, 10, 10]
    assert out.stats.generated_tokens == 30


def test_stats_are_consistent():
    target = SyntheticTarget(vocab_size=8, sharpness=1.0)
    drafter = SyntheticDrafter(target, (2, 1, 1), "sampled_iid", 0.4)
    out = SpecDecoder(target, drafter, reference.verify).generate([[1, 2]] * 64, 40, SamplingParams(1.0))
    s = out.stats
    assert s.generated_tokens == 64 * 40
    assert sum(s.accepted_histogram) == s.request_steps
    assert s.survival[0] == 1.0 and all(a >= b for a, b in zip(s.survival, s.survival[1:]))
    # tau counts the bonus token; emitted tokens can exceed generated ones only by final-step overshoot
    assert s.tau * s.request_steps >= s.generated_tokens
    assert len(s.per_depth_alpha) == 3 and all(0 < a < 1 for a in s.per_depth_alpha)
    assert sum(s.accepted_rank_histogram) == sum(n * c for n, c in enumerate(s.accepted_histogram))
    assert len(s.accepted_rank_histogram) == 2  # two root children: rank 0 and rank 1 accepted
    t = s.time
    assert t.prefill_s > 0 and t.total_s >= t.prefill_s + t.draft_s + t.target_s + t.verify_s
    assert t.overhead_share == pytest.approx(t.other_s / t.total_s)
    assert len(out.steps) == s.num_steps


@pytest.mark.parametrize(
    "prompts,max_new,match",
    [([[]], 5, "prompt 0 is empty"), ([], 5, "no prompts"), ([[1]], 0, "max_new_tokens"),
     ([[1] * 10], 10, "context window")],
)
def test_bad_input_gets_a_clear_error(prompts, max_new, match):
    target = SyntheticTarget(vocab_size=8, max_length=16)
    with pytest.raises(ValueError, match=match):
        SpecDecoder(target, None, reference.verify).generate(prompts, max_new, GREEDY)


def test_drafter_modes_are_named_by_string_or_enum():
    target = SyntheticTarget()
    assert SyntheticDrafter(target, mode="sampled_wor").mode is SiblingMode.SAMPLED_WOR
    with pytest.raises(ValueError):
        SyntheticDrafter(target, branching=(0,))


def test_on_cuda_the_phase_clock_marks_the_stream_and_waits_only_at_the_end(monkeypatch):
    """Each phase is charged the device timeline between its two events; nothing waits for the
    device until split() (a fake stream: each event records the time the host has reached)."""
    from specdec import decode

    now, syncs, reached = [0.0], [], [0.0]  # reached: how far the device has run

    class Event:
        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing

        def record(self) -> None:
            self.at = now[0]

        def query(self) -> bool:
            return self.at <= reached[0]

        def elapsed_time(self, end: "Event") -> float:  # ms
            assert syncs or end.query(), "an event was read before the device passed it"
            return (end.at - self.at) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: syncs.append(now[0]))
    clock = decode._Clock(torch.device("cuda"))
    for phase, seconds in [("prefill", 0.5), ("draft", 0.25), ("target", 2.0), ("verify", 0.125), ("draft", 0.25)]:
        with clock(phase):
            now[0] += seconds
        now[0] += 1.0  # between phases: the loop's own
    assert syncs == []
    split = clock.split()
    assert len(syncs) == 1
    assert (split.prefill_s, split.draft_s, split.target_s, split.verify_s) == (0.5, 0.5, 2.0, 0.125)

    # past HELD marks, those the device has passed are read and dropped without a wait
    monkeypatch.setattr(decode._Clock, "HELD", 2)
    clock, syncs[:] = decode._Clock(torch.device("cuda")), []
    for step in range(6):
        with clock("target"):
            now[0] += 1.0
            reached[0] = now[0] - 1.5  # the device runs a phase or so behind the host
        assert len(clock._marks) == min(step + 1, 2)
    assert syncs == [] and clock._spent["target"] == 4.0
    assert clock.split().target_s == 6.0 and len(syncs) == 1
