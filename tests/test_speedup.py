import os
from pathlib import Path

import pytest
from tiny_models import tiny_model

from specdec.speedup import (
    ForwardProfile,
    TreeShape,
    best_tree_taus,
    chain_tau,
    choose_tree_budget,
    expected_tau,
    load_profile,
    predicted_speedup,
    profile_forward,
)
from specdec.target import HFTarget


def test_chain_tau_matches_the_closed_form():
    for alpha, k in [(0.7, 4), (0.3, 1), (0.9, 8)]:
        assert chain_tau(alpha, k) == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha))
    assert expected_tau([]) == 1.0 and expected_tau([1.0] * 5) == 6.0


def test_the_essay_example_predicts_about_two_x():
    """alpha 0.7, k 4, drafter cost 0.1 per draft token, verification as cheap as one token."""
    tau = chain_tau(0.7, 4)
    assert predicted_speedup(tau, 1.0, 1.0, 4 * 0.1) == pytest.approx(tau / 1.4)
    assert 1.9 < tau / 1.4 < 2.4


def test_profile_interpolates_and_ratios():
    profile = ForwardProfile([1, 4, 8], [0.1, 0.2, 0.4], 128)
    assert profile.time(2) == pytest.approx(0.1 + 0.1 / 3)
    assert profile.time(100) == 0.4 and profile.ratios()[8] == pytest.approx(4.0)


def test_profile_forward_keeps_the_context_fixed():
    target = HFTarget(tiny_model("llama"))
    profile = profile_forward(target, [1, 3, 5], context_length=16, repeats=2)
    assert profile.sizes == [1, 3, 5] and all(t > 0 for t in profile.seconds)
    assert int(target.cached_lengths[0]) == 15  # prefill caches all but the root, repeats roll back
    batched = profile_forward(target, [1, 3], context_length=8, repeats=1, batch_size=3)
    assert batched.batch_size == 3 and target.cached_lengths.tolist() == [7, 7, 7]


def flat_then_steep(flat_up_to: int, largest: int) -> ForwardProfile:
    """T(n) = 1 while n <= flat_up_to (memory-bound), then +1 per extra token."""
    sizes = list(range(1, largest + 1))
    return ForwardProfile(sizes, [1.0 + max(n - flat_up_to, 0) for n in sizes], 128)


def test_chain_budget_stops_where_verification_stops_being_free():
    profile = flat_then_steep(5, 12)
    budget = choose_tree_budget(profile, [0.8] * 8, draft_s_per_depth=0.0, max_depth=8)
    # depth 4 fills T(5) = 1; depth 5 gains 0.8^5 = 0.33 tokens but doubles the step
    assert (budget.best.depth, budget.best.num_nodes) == (4, 4)
    assert budget.best.tau == pytest.approx(chain_tau(0.8, 4)) and budget.best.speedup == pytest.approx(chain_tau(0.8, 4))
    assert [p.depth for p in budget.curve] == list(range(1, 9))
    # a drafter costing half a target forward per token: tau_d / (1 + d/2) peaks at d = 2
    assert choose_tree_budget(profile, [0.8] * 8, draft_s_per_depth=0.5, max_depth=8).best.depth == 2


def test_tree_budget_picks_the_best_nodes_by_path_probability():
    """Two ranks accepted 3:1, alpha 0.8 at both depths: nodes are worth 0.6 (rank 0), 0.2 (rank 1),
    0.36 and 0.12 (its children); verification is free up to 4 rows, so the best is the 3 nodes
    0.6, 0.36, 0.2: tau 2.16 at depth 2."""
    profile = ForwardProfile([1, 4, 5], [1.0, 1.0, 10.0], 128)
    budget = choose_tree_budget(profile, [0.8, 0.8], 0.0, rank_share=[0.75, 0.25], max_depth=3, max_nodes=6)
    assert (budget.best.depth, budget.best.num_nodes) == (2, 3)
    assert budget.best.tau == pytest.approx(2.16)
    # then 0.12 twice (rank 1 under rank 0, rank 0 under rank 1), 0.04, and nothing more
    assert best_tree_taus([0.8, 0.8], [0.75, 0.25], 2, 7) == pytest.approx([1.6, 1.96, 2.16, 2.28, 2.4, 2.44, 2.44])
    assert best_tree_taus([0.8, 0.8], [0.75, 0.25], 1, 3) == pytest.approx([1.6, 1.8, 1.8])  # depth 1: two ranks only


def test_tree_budget_lists_only_trees_the_drafter_can_build():
    """An EAGLE-2 tree with top_k 2 holds 2 nodes at depth 1 and 4 more per further depth: with
    free verification the chooser must not offer 6 nodes at depth 1 (whose tau it would credit
    with depth-1 ranks the drafter never drafts) but 6 at depth 2."""
    from drafters.base import tree_shape

    shape = tree_shape("eagle3", {"top_k": 2, "total_tokens": 32})
    assert shape == TreeShape(children=2, parents=2)
    assert [shape.capacity(d) for d in (1, 2, 3)] == [2, 6, 10]
    assert TreeShape(children=2).capacity(3) == 14  # every node may have children
    assert tree_shape("ngram", {}) == TreeShape() and TreeShape().capacity(3) is None  # no declared bound
    profile = ForwardProfile([1, 8], [1.0, 1.0], 128)
    budget = choose_tree_budget(profile, [0.8, 0.8], 0.0, [0.6, 0.4], max_depth=2, max_nodes=6, shape=shape)
    assert [(p.depth, p.num_nodes) for p in budget.curve] == [(1, 1), (1, 2), (2, 2), (2, 3), (2, 4), (2, 5), (2, 6)]
    assert (budget.best.depth, budget.best.num_nodes) == (2, 6)
    uncapped = choose_tree_budget(profile, [0.8, 0.8], 0.0, [0.6, 0.4], max_depth=2, max_nodes=6)
    assert len(uncapped.curve) == 6 + 5


def test_tree_budget_expands_at_most_the_frontier_per_depth():
    """One rank, alpha 0.9 at every depth: the best 4-node tree unbounded is a chain of 4, but
    with shares 0.5 / 0.5 and top_k 1 parent per depth the tree may branch only under one node
    of each depth, as EAGLE-2 with a 1-node frontier drafts it."""
    alpha, shares = [0.9, 0.9, 0.9], [0.5, 0.5]
    # nodes by value: 0.45, 0.45 (depth 1), 0.2025 x 4 (depth 2): free choice takes 4 at depth 2
    free = best_tree_taus(alpha, shares, 2, 6)
    assert free == pytest.approx([1.45, 1.9, 2.1025, 2.305, 2.5075, 2.71])
    # one parent per depth: only one depth-1 node gets children, so depth 2 holds 2 nodes
    narrow = best_tree_taus(alpha, shares, 2, 6, TreeShape(children=2, parents=1))
    assert narrow == pytest.approx([1.45, 1.9, 2.1025, 2.305, 2.305, 2.305])
    # and depth 3 then continues under one depth-2 node only
    deep = best_tree_taus(alpha, shares, 3, 8, TreeShape(children=2, parents=1))
    assert deep == pytest.approx([1.45, 1.9, 2.1025, 2.305, 2.396125, 2.48725, 2.48725, 2.48725])


def test_budget_rejects_meaningless_input():
    profile = flat_then_steep(2, 4)
    with pytest.raises(ValueError, match="per-depth acceptance"):
        choose_tree_budget(profile, [], 0.0)
    with pytest.raises(ValueError, match="rank_share"):
        choose_tree_budget(profile, [0.5], 0.0, rank_share=[0.5, 0.2])


def test_profile_round_trips_through_csv(tmp_path):
    path = tmp_path / "tn.csv"
    path.write_text("n,seconds,ratio,context,threads,dtype\n4,0.2,2.0,256,2,float32\n1,0.1,1.0,256,2,float32\n")
    profile = load_profile(path)
    assert profile.sizes == [1, 4] and profile.seconds == [0.1, 0.2] and profile.context_length == 256
    assert profile.batch_size == 1
    (tmp_path / "bad.csv").write_text("size,time\n1,0.1\n")
    with pytest.raises(ValueError, match="columns n and seconds"):
        load_profile(tmp_path / "bad.csv")
    with pytest.raises(FileNotFoundError, match="bench_target"):
        load_profile(tmp_path / "missing.csv")


def count_budget_builds(monkeypatch) -> list[str]:
    """The drafters budget.mode=auto builds before the run's own (their names, in order)."""
    from experiments.run import budget

    built, build = [], budget.build_drafter
    monkeypatch.setattr(budget, "build_drafter", lambda options, target: built.append(options["name"]) or build(options, target))
    return built


@pytest.mark.integration
def test_specdec_run_chooses_the_budget_and_records_it(tmp_path, monkeypatch):
    from test_run_cli import run_in_process

    from experiments.cli import SpecdecUserError

    built = count_budget_builds(monkeypatch)

    model_dir = tmp_path / "tiny"
    tiny_model("llama", sharpness=4.0).save_pretrained(model_dir)
    overrides = ["target=hf", f"target.path={model_dir}", "workload=synthetic", "workload.num_prompts=2",
                 "workload.prompt_length=40", "max_new_tokens=8", "drafter=ngram", "logger=none", "warmup_tokens=0",
                 "budget.mode=auto", "budget.max_depth=3", "budget.max_nodes=3", "budget.calibration_prompts=1"]
    results = run_in_process(tmp_path / "calibrated", overrides)
    budget = results["budget"]
    assert budget["mode"] == "auto" and budget["acceptance"]["source"] == "calibration"
    assert set(budget["chosen"]) == {"num_draft"} and 1 <= budget["chosen"]["num_draft"] <= 3
    assert [p["depth"] for p in budget["curve"]] == [1, 2, 3] and budget["profile"]["sizes"] == [1, 2, 3, 4]
    assert budget["predicted"] == max(budget["curve"], key=lambda p: p["tokens_per_s"])
    assert results["mean_tree_nodes"] <= budget["chosen"]["num_draft"] and results["greedy_equal"] is True
    assert built == ["ngram"]  # the calibration's alone: n-grams declare no depth bound to read
    # again from that run's acceptance and a T(n) file instead of a calibration and a measurement
    profile = tmp_path / "tn.csv"
    profile.write_text("n,seconds\n1,0.1\n2,0.1\n3,0.1\n4,0.1\n")  # verification is free up to 3 drafts
    reused = run_in_process(tmp_path / "reused", [*overrides, f"budget.profile={profile}",
                                                  f"budget.acceptance={tmp_path / 'calibrated' / 'results.json'}"])
    assert reused["budget"]["acceptance"]["per_depth_alpha"] == results["per_depth_alpha"]
    assert reused["budget"]["profile"]["source"] == str(profile)
    with pytest.raises(SpecdecUserError, match="drafter synthetic declares neither"):
        run_in_process(tmp_path / "bad", ["experiment=synthetic", "budget.mode=auto"])


@pytest.mark.integration
def test_the_budget_considers_no_depth_past_what_the_drafter_can_draft(tmp_path, monkeypatch):
    """A Domino head drafts at most its block less the root (2 here): budget.max_depth=4 is capped to it, for the
    calibration and for the chooser, and the cap is recorded."""
    from test_run_cli import run_in_process

    from drafters.domino import DominoConfig, DominoHead

    from drafters.formats.load import save_domino

    built = count_budget_builds(monkeypatch)

    model = tiny_model("llama", sharpness=4.0)
    model.save_pretrained(tmp_path / "tiny")
    save_domino(DominoHead(DominoConfig.for_target(HFTarget(model), (1, 3), block_size=3)), tmp_path / "head")
    profile = tmp_path / "tn.csv"
    profile.write_text("n,seconds\n1,0.1\n2,0.1\n3,0.1\n4,0.1\n5,0.1\n")
    results = run_in_process(tmp_path / "run", [
        "target=hf", f"target.path={tmp_path / 'tiny'}", "workload=synthetic", "workload.num_prompts=2",
        "workload.prompt_length=40", "max_new_tokens=8", "drafter=domino", f"drafter.checkpoint={tmp_path / 'head'}",
        "logger=none", "warmup_tokens=0", "budget.mode=auto", "budget.max_depth=4", "budget.max_nodes=4",
        "budget.calibration_prompts=1", f"budget.profile={profile}"])
    budget = results["budget"]
    assert budget["max_depth"] == 2 and [p["depth"] for p in budget["curve"]] == [1, 2]
    assert 1 <= budget["chosen"]["depth"] <= 2
    assert built == ["domino", "domino"]  # one to read its bound, then the calibration's


@pytest.mark.integration
def test_the_model_predicts_the_loop_on_a_target_of_known_speed():
    """Simulated costs (T(1) = 40 ms, T(n)/T(1) = 1 + 0.05 (n - 1), 4 ms per draft level): the
    model's inputs are then exact, so measured and predicted speedup may differ only by the loop's
    own overhead, which must stay small (a few ms per step even on a loaded 2-core machine: at
    10 ms forwards that broke the 15% bound twice)."""
    from drafters.synthetic import SyntheticDrafter
    from specdec.decode import SpecDecoder
    from specdec.sampling import SamplingParams
    from specdec.synthetic import SyntheticTarget
    from verifiers.reference import verify

    target = SyntheticTarget(vocab_size=16, sharpness=2.0, forward_ms=40.0, row_cost=0.05)
    prompts = [[1, 2, 3], [4, 5, 6]]
    drafter = SyntheticDrafter(target, (1, 1, 1), "deterministic", divergence=0.2, depth_ms=4.0)
    decode_s = lambda g: g.stats.time.total_s - g.stats.time.prefill_s  # the model leaves out the prefill
    ratios = []  # measured / predicted, three times: one VM stall of ~50 ms moves a single ratio by 10%
    for _ in range(3):
        plain = SpecDecoder(target, None, verify).generate(prompts, 24, SamplingParams(0.0))
        spec = SpecDecoder(target, drafter, verify).generate(prompts, 24, SamplingParams(0.0))
        assert spec.outputs == plain.outputs
        steps = spec.stats.num_steps
        # tokens per batch step: the batch pays for every step until its slowest request finishes
        # (tau, per request-step, would predict 8 steps where the batch ran 9)
        kept_tau = spec.stats.generated_tokens / (len(prompts) * spec.stats.num_steps)
        predicted = predicted_speedup(kept_tau, 0.040, 0.040 * (1 + 0.05 * 3), 0.012)
        assert spec.stats.time.target_s >= steps * 0.040 * (1 + 0.05 * 3) * 0.999  # the sleep is a floor
        ratios.append(decode_s(plain) / decode_s(spec) / predicted)  # same tokens on both sides
    assert sorted(ratios)[1] == pytest.approx(1.0, rel=0.10)


def test_bench_target_writes_a_profile_specdec_run_can_load(tmp_path):
    from benchmarks import bench_target

    path = tmp_path / "tn.csv"
    bench_target.main(["--random", "tiny", "--sizes", "1", "2", "5", "--repeats", "1", "--context", "8",
                       "--batch", "2", "--threads", "1", "--packed-gemm-from", "4", "--out", str(path)])
    profile = load_profile(path)
    assert profile.sizes == [1, 2, 5] and profile.batch_size == 2 and profile.context_length == 8
    assert all(s > 0 for s in profile.seconds) and profile.ratios()[1] == 1.0
    header = path.read_text().splitlines()[0].split(",")
    # on a CPU: the stock-kernel target and both matmul-only bounds, measured alongside
    assert {"stock_seconds", "matmul_ratio", "stock_matmul_ratio", "device"} <= set(header)
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as any file written here, not a private temp file's 0600
    with pytest.raises(SystemExit):
        bench_target.main(["--random", "tiny", "--sizes", "2", "4"])  # no T(1) to divide by


def test_project_speedup_picks_a_budget_per_profile(tmp_path, capsys):
    from benchmarks import project_speedup

    results = tmp_path / "results.json"
    results.write_text('{"per_depth_alpha": [0.8, 0.7, 0.6], "accepted_rank_histogram": [90, 10]}')
    flat, steep = tmp_path / "flat.csv", tmp_path / "steep.csv"
    flat.write_text("n,seconds,batch\n1,0.010,1\n4,0.010,1\n8,0.0105,1\n")  # verification nearly free
    steep.write_text("n,seconds,batch\n1,0.010,8\n2,0.020,8\n8,0.080,8\n")  # cost grows with every row
    project_speedup.main(["--acceptance", str(results), "--profile", str(flat), str(steep), "--draft-cost", "0.01"])
    lines = capsys.readouterr().out.splitlines()
    flat_row, steep_row = lines[-2].split(), lines[-1].split()
    assert int(flat_row[3]) == 3 and float(flat_row[-1].rstrip("x")) > 2  # the whole measured depth pays
    assert int(steep_row[1]) == 8 and float(steep_row[-1].rstrip("x")) < 1  # nothing pays: 1 node, a loss
    with pytest.raises(SystemExit):
        project_speedup.main(["--acceptance", str(tmp_path / "missing.json"), "--profile", str(flat), "--draft-cost", "0"])
    # a depth reached 3 times says nothing: it is dropped, not credited with its chance alpha of 1.0
    results.write_text('{"per_depth_alpha": [0.8, 0.7, 1.0], "per_depth_attempts": [500, 400, 3], '
                       '"accepted_rank_histogram": [90, 10]}')
    project_speedup.main(["--acceptance", str(results), "--profile", str(flat), "--draft-cost", "0.01"])
    out = capsys.readouterr().out
    assert "[0.8, 0.7] (depth 3 dropped: too few attempts)" in out and int(out.splitlines()[-1].split()[3]) == 2


def test_alphas_stop_at_the_first_depth_measured_too_rarely():
    from specdec.speedup import MIN_ALPHA_ATTEMPTS, measured_alphas

    assert measured_alphas([0.6, 0.5, 0.5, 1.0], [900, 400, MIN_ALPHA_ATTEMPTS, 3]) == [0.6, 0.5, 0.5]
    assert measured_alphas([0.6, 1.0, 0.5], [900, 2, 400]) == [0.6]  # nothing past a rare depth either
    assert measured_alphas([1.0], [1]) == [1.0]  # depth 1 stays: the chooser needs something
    assert measured_alphas([0.6, 1.0], None) == [0.6, 1.0]  # an older results.json without counts


def test_the_gpu_script_projects_from_a_committed_acceptance_file(capsys):
    """scripts/gpu_check.sh projects 8B speedups on the device from a SmolLM2 acceptance file in
    docs/data/: it must exist on a clean checkout and hold enough measured depths to project from."""
    import re

    from benchmarks import project_speedup

    root = Path(__file__).resolve().parent.parent
    acceptance = re.search(r"--acceptance (\S+)", (root / "scripts" / "gpu_check.sh").read_text()).group(1)
    profile = root / "docs" / "data" / "tn" / "tn-smollm2-amd-fp32.csv"
    project_speedup.main(["--acceptance", str(root / acceptance), "--profile", str(profile), "--draft-cost", "0.05"])
    alphas = re.search(r"alpha per depth \[([^\]]*)\]", capsys.readouterr().out).group(1).split(", ")
    assert len(alphas) >= 4
