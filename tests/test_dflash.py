"""DFlash block drafting: exact decoding through the loop, the draft KV cache across commits and
admissions, the head's training objective, and its checkpoints."""

from __future__ import annotations

import pytest
import torch

from drafters.dflash import DFlashConfig, DFlashDrafter, DFlashHead
from drafters.formats.load import dflash, load_dflash, save_dflash
from drafters.training.dflash_training import BlockBatch, sample_anchors
from drafters.training.features import CacheMeta, FeatureCache, extract_features
from drafters.training.methods import build_method
from drafters.training.trainer import TrainConfig, train
from specdec.decode import SpecDecoder
from specdec.protocols import DraftContext
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from tiny_models import tiny_model
from verifiers import reference

GREEDY = SamplingParams(0.0)


def random_head(target, head_class=DFlashHead, config_class=DFlashConfig, seed=0, draft_ids=None, **sizes):
    """A head whose every weight is large enough to move its drafts (an init leaves the norms at 1)."""
    torch.manual_seed(seed)
    head = head_class(config_class.for_target(target, (1, 3), block_size=4, num_layers=2, **sizes), draft_ids)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    return head.eval()


def test_greedy_blocks_equal_plain_decoding_ragged_and_admitted():
    """Ragged prompts (one of a single token: no context at all), then the same with requests
    admitted into a running batch: the draft cache of each request is its own."""
    target = HFTarget(tiny_model("llama", sharpness=4.0))
    head = random_head(target)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 9, 11], [3], [40, 41, 42], [7, 7, 7, 7]]
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, 14, GREEDY)
    for depth, max_batch in [(None, None), (2, 2)]:
        out = SpecDecoder(target, DFlashDrafter(target, head, depth), reference.verify).generate(
            prompts, 14, GREEDY, max_batch=max_batch)
        assert out.outputs == plain.outputs, (depth, max_batch)


def test_the_context_cache_after_commits_is_the_whole_prefix_recomputed():
    """The last block drafted while decoding (its context cache written step by step, no block
    ever kept) equals the block of a fresh drafter that reads the whole committed text at once; a
    drafter whose cache lacks the last step's rows drafts another block (the check can fail)."""
    target = HFTarget(tiny_model("llama", sharpness=4.0))
    head = random_head(target, seed=2)
    drafter = DFlashDrafter(target, head)
    steps = []
    propose = drafter.propose
    drafter.propose = lambda ctx: steps.append((ctx, propose(ctx))) or steps[-1][1]
    SpecDecoder(target, drafter, reference.verify).generate([[5, 9, 17, 3]], 12, GREEDY)
    last, drafted = steps[-1]
    length = int(last.lengths[0])
    text = last.tokens[0, :length]
    hidden = target.prefill([text], drafter.target_layers).hidden  # rows of x_0..x_{r-1}

    def block(rows: int) -> torch.Tensor:
        fresh = DFlashDrafter(target, head)
        fresh.reset(1, 64)
        fresh.propose(DraftContext(text[None, : rows + 1], torch.tensor([rows + 1]), tuple(h[:, :rows] for h in hidden),
                                   torch.tensor([rows]), GREEDY, None))  # the cache holds rows 0..rows-1
        return fresh.propose(DraftContext(text[None], last.lengths, hidden, torch.zeros(1, dtype=torch.int64),
                                          GREEDY, None)).tokens

    assert len(steps) > 2 and torch.equal(drafted.tokens, block(length - 1))
    assert not torch.equal(drafted.tokens, block(length - 1 - int(last.num_new[0])))


def test_blocks_run_together_as_each_runs_alone():
    """Training runs many blocks of a sequence in one forward (each sees the context before its
    anchor and its own block only); each must get the rows it gets when drafted alone."""
    target = HFTarget(tiny_model("llama", sharpness=4.0))
    head = random_head(target, seed=4)
    text = torch.tensor([5, 9, 17, 3, 44, 21, 8, 60, 2, 11])
    features = torch.cat(target.prefill([text], head.config.feature_layers).hidden, -1)  # rows of text[:-1]
    t, k = features.shape[1], head.config.block_size
    anchors = torch.tensor([[1, 4, 8]])
    embed = target.model.get_input_embeddings()
    ids = torch.where(torch.arange(k) == 0, text[anchors][..., None], head.config.mask_token_id)  # [1, 3, K]
    with torch.no_grad():
        together = head(embed(ids), anchors[..., None] + torch.arange(k), head.context(features, torch.arange(t)[None]),
                        torch.arange(t) < anchors[..., None])
        for i, a in enumerate(anchors[0].tolist()):
            alone = head(embed(ids[:, i : i + 1]), (a + torch.arange(k))[None, None],
                         head.context(features[:, :a], torch.arange(a)[None]), torch.ones(1, 1, a, dtype=torch.bool))
            torch.testing.assert_close(together[:, i], alone[:, 0])


def test_depth_bounds_and_a_missing_checkpoint_are_clear_errors(tmp_path):
    target = HFTarget(tiny_model("llama"))
    head = random_head(target)
    assert DFlashDrafter(target, head).max_depth == 3  # block 4: the root and 3 drafted tokens
    with pytest.raises(ValueError, match=r"depth must lie in \[1, 3\]"):
        DFlashDrafter(target, head, depth=4)
    with pytest.raises(ValueError, match="no dflash head is bundled for .*specdec-train train=dflash"):
        dflash(target)
    save_dflash(head, tmp_path / "head")
    other = HFTarget(tiny_model("llama", vocab_size=64, layers=3))
    with pytest.raises(ValueError, match="made for another target.*vocabulary: head 128, target 64; layers: head 2, target 3"):
        load_dflash(tmp_path / "head", other)
    with pytest.raises(ValueError, match="mask_token_id 200 is not a token"):
        DFlashConfig.for_target(target, mask_token_id=200)


def test_anchors_are_distinct_labelled_positions_in_order():
    valid = torch.tensor([[True] * 6 + [False] * 4, [False, True, True] + [False] * 7])
    anchors, kept = sample_anchors(valid, 4, torch.Generator().manual_seed(0))
    assert anchors.shape == (2, 4) and kept.sum(1).tolist() == [4, 2]
    first = anchors[0].tolist()
    assert first == sorted(first) and len(set(first)) == 4 and max(first) < 6
    assert anchors[1, kept[1]].tolist() == [1, 2]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """Features of the tiny target's own greedy continuations (what a self-distilled head learns)."""
    tmp_path = tmp_path_factory.mktemp("dflash")
    target = HFTarget(tiny_model("llama", sharpness=4.0))
    prompts = [[i, (7 * i) % 128, (13 * i) % 128] for i in range(8)]
    continuations = SpecDecoder(target, None, reference.verify).generate(prompts, 29, GREEDY).outputs
    meta = CacheMeta("tiny", target.hidden_size, target.num_layers, target.vocab_size, (1, 3), 64, 2)
    directory = extract_features(target, [p + c for p, c in zip(prompts, continuations)], tmp_path / "features", meta, 2)
    return target, prompts, FeatureCache(directory), tmp_path


@pytest.mark.parametrize("name", ["dflash", "domino"])
def test_training_learns_the_blocks_and_the_export_drafts_them(cache, name):
    """A short run on 8 memorised sequences: the weighted block CE falls, the exported SpecForge
    folder loads back and drafts whole blocks the target accepts, greedy output unchanged."""
    target, prompts, features, tmp_path = cache
    settings = {"name": name, "feature_layers": [1, 3], "block_size": 4, "num_anchors": 16, "gamma": 4.0}
    if name == "domino":
        settings.update(gru_size=16, emb_dim=16, lambda_steps=80, draft_vocab=100)
    method = build_method(settings)
    torch.manual_seed(0)
    prepared = method.prepare(target, features, 4, 0, [0, 1, 2, 3])
    first, _ = prepared.loss(next(prepared.batches(0)))
    logged = []
    train(prepared.model, prepared.batches, prepared.loss,
          TrainConfig(steps=80, lr=1e-2, warmup_steps=5, checkpoint_every=80, log_every=20),
          tmp_path / f"run-{name}", lambda step, metrics: logged.append(metrics))
    assert logged[-1]["loss"] < 0.3 * float(first.detach())
    assert logged[-1]["accuracy_1"] > 0.8
    if name == "domino":
        assert logged[-1]["lambda_base"] == 0.0 and "ce_final" in logged[-1]  # lambda reached 0 halfway
    method.export(prepared.model.half(), tmp_path / name, {"training": {"steps": 80}})
    head = method.load(target, tmp_path / name)
    plain = SpecDecoder(target, None, reference.verify).generate(prompts[:3], 20, GREEDY)
    out = SpecDecoder(target, method.drafter(target, head, 8), reference.verify).generate(prompts[:3], 20, GREEDY)
    assert out.outputs == plain.outputs and out.stats.tau > 2.0


def test_a_batch_without_labels_gives_a_zero_loss(cache):
    target, _, features, _ = cache
    prepared = build_method({"name": "dflash", "feature_layers": [1, 3], "block_size": 4, "num_anchors": 4}).prepare(
        target, features, 2, 0, [0])
    batch = next(prepared.batches(0))
    empty = BlockBatch(batch.features, batch.tokens, torch.full_like(batch.labels, -1), torch.zeros_like(batch.valid), 0)
    loss, metrics = prepared.loss(empty)
    assert float(loss.detach()) == 0.0 and metrics["accept_length"] == 0.0


def test_alpha_counts_a_depth_only_where_every_depth_before_it_was_right():
    """Four blocks of depths 1..3 (row 0 is the root): accuracy_j is top-1 among the rows labelled
    at depth j, alpha_j among those whose earlier depths were all right, as the decode loop counts;
    a label outside the draft vocabulary (valid false, in_data true) is a miss for alpha only."""
    from drafters.training.dflash_training import depth_metrics

    T, F = True, False
    correct = torch.tensor([[[F, T, F, T], [F, T, T, F], [F, F, T, T], [F, T, F, F]]])  # [1, 4, 4]
    valid = torch.tensor([[[F, T, T, T], [F, T, T, T], [F, F, T, T], [F, T, F, F]]])
    in_data = torch.tensor([[[F, T, T, T], [F, T, T, T], [F, T, T, T], [F, T, F, F]]])  # block 4 ends the data
    metrics = depth_metrics(correct, valid, in_data, torch.ones(1, 4, dtype=torch.bool), label_shift=0)
    assert metrics["accuracy_1"] == 1.0 and metrics["alpha_1"] == 0.75
    assert metrics["accuracy_2"] == pytest.approx(2 / 3) and metrics["alpha_2"] == 0.5
    assert metrics["accuracy_3"] == pytest.approx(2 / 3) and metrics["alpha_3"] == 0.0
    assert metrics["accept_length"] == 1.0  # 1, 2, 0 and 1 depths in a row
    shifted = depth_metrics(correct[..., 1:], valid[..., 1:], in_data[..., 1:], torch.ones(1, 4, dtype=torch.bool), 1)
    assert shifted == metrics  # Domino's shifted labels: row j - 1 drafts depth j


def test_the_chunked_cross_entropy_is_the_whole_ones_loss_gradient_and_argmax(monkeypatch):
    from drafters.training import dflash_training

    torch.manual_seed(0)
    rows, lm_head = torch.randn(10, 8, requires_grad=True), torch.randn(50, 8, requires_grad=True)
    target, weight = torch.randint(0, 50, (10,)), torch.rand(10)
    logits = rows @ lm_head.T
    whole = (torch.nn.functional.cross_entropy(logits, target, reduction="none") * weight).sum() / weight.sum()
    whole_grads = torch.autograd.grad(whole, (rows, lm_head))
    monkeypatch.setattr(dflash_training, "CE_ROWS", 3)  # four chunks, the last one short
    chunked, argmax = dflash_training.chunked_ce(rows, lm_head, target, weight)
    chunked_grads = torch.autograd.grad(chunked, (rows, lm_head))
    assert torch.allclose(chunked, whole, rtol=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(chunked_grads, whole_grads))
    assert torch.equal(argmax, logits.argmax(-1))
