"""Head training: the feature cache, the resumable trainer, EAGLE losses and checkpoints."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from drafters.eagle import EagleConfig, EagleDrafter, EagleHead, load_head
from drafters.heads import save_head
from drafters.training.data import EagleData, chat_sequences, select_draft_vocab
from drafters.training.eagle_training import EagleLoss, EagleLossConfig, teacher_forced_accuracy
from drafters.training.features import CacheMeta, FeatureCache, extract_features, shard_name
from drafters.training.trainer import TrainConfig, train
from specdec.assets import Conversation
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from tiny_models import tiny_model
from verifiers import reference


def make_cache(tmp_path, target, sequences, layers=(1, 3)):
    meta = CacheMeta("tiny", target.hidden_size, target.num_layers, target.vocab_size, layers, 64, 2)
    return extract_features(target, sequences, tmp_path / "features", meta, batch_size=2), meta


def repetitive_sequences(count=6, length=40, seed=0):
    generator = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 128, (8,), generator=generator).tolist()
    return [(base * 10)[i : i + length] for i in range(count)]


def cache_rows(cache, shard, layer):  # [T, H] one layer of one shard
    from safetensors import safe_open

    with safe_open(str(cache.shards[shard]), framework="pt") as f:
        return f.get_tensor(f"layer_{layer}")


def test_feature_cache_round_trip_and_resume(tmp_path):
    target = HFTarget(tiny_model("llama"))
    sequences = repetitive_sequences(5)
    directory, meta = make_cache(tmp_path, target, sequences)
    cache = FeatureCache(directory)
    assert len(cache.shards) == 3 and cache.num_tokens() == 5 * 40
    first = next(cache.sequences((3,)))
    expected = target.prefill([torch.tensor(sequences[0] + [0])], (3,)).hidden[0][0]
    assert torch.allclose(first.features[3].float(), expected, atol=1e-2)  # float16 storage
    # a killed extraction leaves whole shards only; rerunning fills in exactly what is missing
    (directory / shard_name(1)).unlink()
    before = (directory / shard_name(0)).stat().st_mtime_ns
    extract_features(target, sequences, directory, meta)
    assert (directory / shard_name(1)).exists() and (directory / shard_name(0)).stat().st_mtime_ns == before
    lm_head = target.model.get_output_embeddings().weight.detach()
    # extraction labelled every shard it wrote (the final-norm output, layer 3, is stored) ...
    labels = [directory / "choices" / shard_name(i) for i in range(3)]
    assert all(path.exists() for path in labels)
    stamps = [path.stat().st_mtime_ns for path in labels]
    choices = cache.target_choices([0], lm_head, 3)
    assert torch.equal(choices, (cache_rows(cache, 0, 3).float() @ lm_head.T).argmax(-1))
    # ... with the labels a training computes, so it reads them instead of recomputing
    assert [path.stat().st_mtime_ns for path in labels] == stamps
    assert not torch.equal(cache.target_choices([0], lm_head * -1, 3), choices)  # another head: recomputed
    assert labels[0].stat().st_mtime_ns != stamps[0]
    with pytest.raises(ValueError, match="another configuration"):
        extract_features(target, sequences, directory, CacheMeta("other", 64, 2, 128, (1,), 64, 2))
    with pytest.raises(ValueError, match="not in the feature cache"):
        next(cache.sequences((2,)))


def test_a_layer_past_float16s_range_is_stored_in_bfloat16_and_trains_finite(tmp_path, monkeypatch):
    """Gemma 3's middle layers reach 1e5, past float16's 65,504: stored in float16 they were
    infinite and EAGLE-3's loss NaN from the first step. Such a layer is stored in bfloat16, the
    others stay float16, and a sequence reads its layers back in one dtype, all finite."""
    from drafters.training.features import storable

    assert storable(torch.tensor([[1.5, -2.0]])).dtype == torch.float16
    wide = storable(torch.tensor([[1.0e5, -3.0]]))
    assert wide.dtype == torch.bfloat16 and wide.float()[0, 0] == pytest.approx(1.0e5, rel=1e-2)
    target = HFTarget(tiny_model("llama"))
    prefill = target.prefill

    def loud(prompts, layers):  # layer 1 of this target past float16, as Gemma 3's middle layers are
        out = prefill(prompts, layers)
        hidden = tuple(h * 1.0e7 if k == 1 else h for k, h in zip(layers, out.hidden))
        return replace(out, hidden=hidden)

    monkeypatch.setattr(target, "prefill", loud)
    cache = FeatureCache(make_cache(tmp_path, target, repetitive_sequences(4))[0])
    assert cache_rows(cache, 0, 1).dtype == torch.bfloat16 and cache_rows(cache, 0, 3).dtype == torch.float16
    first = next(cache.sequences((1, 3)))
    assert {m.dtype for m in first.features.values()} == {torch.bfloat16}
    assert all(bool(torch.isfinite(m.float()).all()) for m in first.features.values())
    assert float(first.features[1].float().abs().max()) > 65_504


def test_extraction_without_the_final_layer_labels_nothing(tmp_path):
    target = HFTarget(tiny_model("llama"))
    directory, _ = make_cache(tmp_path, target, repetitive_sequences(2), layers=(1, 2))
    assert not (directory / "choices").exists()  # labels need the final-norm output (layer 3)


def test_chat_sequences_without_usable_rows_is_a_clear_error():
    class Tokenizer:
        def apply_chat_template(self, messages, tokenize, add_generation_prompt=False):
            return " ".join(m["content"] for m in messages)

        def __call__(self, text, add_special_tokens):
            return {"input_ids": [1] * len(text.split())}

    with pytest.raises(ValueError, match="none of the 2 conversations"):
        chat_sequences(Tokenizer(), [Conversation("a", (("user", "hi"),)), Conversation("b", (("user", "  "),))], 64)


class Interrupt(Exception):
    pass


def test_training_resumes_after_a_kill_exactly(tmp_path):
    def run(run_dir, stop_at=None):
        torch.manual_seed(123)
        model = torch.nn.Linear(4, 1)
        data = torch.randn(64, 4), torch.randn(64, 1)

        def batches(step):
            while True:
                rows = torch.arange(step * 4, step * 4 + 4) % 64
                yield data[0][rows], data[1][rows]
                step += 1

        calls = {"n": 0}

        def loss_fn(batch):
            calls["n"] += 1
            if stop_at is not None and calls["n"] == stop_at:
                raise Interrupt  # a kill between two checkpoints
            x, y = batch
            noise = torch.randn(1) * 0.01  # RNG use must continue identically after a resume
            return ((model(x) - y) ** 2).mean() + noise.squeeze(), {}

        config = TrainConfig(steps=12, lr=1e-2, warmup_steps=2, checkpoint_every=5, log_every=4)
        train(model, batches, loss_fn, config, run_dir)
        return model

    straight = run(tmp_path / "straight")
    with pytest.raises(Interrupt):
        run(tmp_path / "killed", stop_at=8)
    progress = json.loads((tmp_path / "killed" / "state" / "progress.json").read_text())
    assert progress["step"] == 5
    resumed = run(tmp_path / "killed")
    assert torch.equal(straight.weight, resumed.weight) and torch.equal(straight.bias, resumed.bias)


# the fast tier keeps the fused two-layer case; the single-layer one with the feature regression is integration's
@pytest.mark.parametrize("layers,unroll,regression", [pytest.param((3,), 2, 1.0, marks=pytest.mark.integration),
                                                      ((1, 2), 3, 0.0)])
def test_eagle_head_learns_and_round_trips(tmp_path, layers, unroll, regression):
    model = tiny_model("llama", sharpness=4.0)
    target = HFTarget(model)
    # self-distillation data: the target's own greedy continuations, so that generation later
    # visits exactly the states the head was trained on and tau measures the whole pipeline
    # (feature/position alignment between training and drafting included)
    prompts = [[i, (7 * i) % 128, (13 * i) % 128] for i in range(8)]
    continuations = SpecDecoder(target, None, reference.verify).generate(prompts, 37, SamplingParams(0.0)).outputs
    directory, _ = make_cache(tmp_path, target, [p + c for p, c in zip(prompts, continuations)], layers=(1, 2, 3))
    lm_head = model.get_output_embeddings().weight.detach()
    data = EagleData(FeatureCache(directory), layers, lm_head, 3, batch_size=4)
    torch.manual_seed(0)
    draft_ids = select_draft_vocab(data.label_counts(128), 100)  # fewer than the 128 tokens
    head = EagleHead(EagleConfig.for_target(target, layers, len(draft_ids)), draft_ids)
    loss = EagleLoss(head, model.get_input_embeddings().weight.detach(), lm_head,
                     EagleLossConfig(unroll=unroll, regression_weight=regression, feature_noise=0.05))
    first, _ = loss(next(data.batches(0)))
    logged = []
    train(head, data.batches, loss, TrainConfig(steps=80, lr=3e-3, warmup_steps=5, checkpoint_every=60, log_every=20),
          tmp_path / "run", lambda step, metrics: logged.append(metrics))
    assert logged[-1]["loss"] < 0.5 * float(first.detach())
    assert logged[-1]["accuracy_0"] > 0.7  # 8 memorised sequences

    save_head(head.half(), tmp_path / "head")
    loaded = load_head(tmp_path / "head", target)
    prompts = prompts[:3]
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, 20, SamplingParams(0.0))
    for top_k, total in [(1, None), (3, 10)]:
        drafter = EagleDrafter(target, loaded, depth=4, top_k=top_k, total_tokens=total)
        out = SpecDecoder(target, drafter, reference.verify).generate(prompts, 20, SamplingParams(0.0))
        assert out.outputs == plain.outputs
    assert out.stats.tau > 2.5  # the trained head drafts what the target will say
    # drafting feeds the head what training did: in-loop depth-1 acceptance = teacher-forced accuracy
    drafter = EagleDrafter(target, loaded, depth=1)
    chain = SpecDecoder(target, drafter, reference.verify).generate(prompts, 20, SamplingParams(0.0))
    accuracy, positions = teacher_forced_accuracy(target, drafter, [p + o for p, o in zip(prompts, plain.outputs)], [3] * 3)
    assert positions == 3 * 19 and abs(accuracy - chain.stats.per_depth_alpha[0]) < 0.1


def test_foreign_and_corrupt_checkpoints_are_clear_errors(tmp_path):
    small = HFTarget(tiny_model("llama"))
    save_head(EagleHead(EagleConfig.for_target(small)), tmp_path / "head")
    other = HFTarget(tiny_model("llama", vocab_size=64, layers=3))
    with pytest.raises(ValueError, match="another target.*vocabulary: checkpoint 128, target 64.*layers: checkpoint 2, target 3"):
        load_head(tmp_path / "head", other)
    (tmp_path / "head" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="corrupt or incomplete"):
        load_head(tmp_path / "head", small)
    with pytest.raises(FileNotFoundError, match="holds no EAGLE checkpoint"):
        load_head(tmp_path / "nothing", small)


def test_training_methods_check_their_settings():
    from drafters.training.methods import build_method

    method = build_method({"name": "eagle3", "feature_layers": [1, 2], "unroll": 3, "regression_weight": 0.0})
    assert method.feature_layers(HFTarget(tiny_model("llama"))) == (1, 2)
    with pytest.raises(ValueError, match="unknown setting.*unrol"):
        build_method({"name": "eagle", "unrol": 3})
    with pytest.raises(ValueError, match="unknown training method"):
        build_method({"name": "nope"})


def test_a_method_registered_without_online_is_refused_for_online_features():
    from drafters.training.methods import METHODS, HeadMethod, check_feature_source

    @METHODS.register("test_cached_only")  # no online=True: it trains on cached features only
    class CachedOnly(HeadMethod):
        name = "test_cached_only"

    try:
        check_feature_source("test_cached_only", "cached")
        with pytest.raises(ValueError) as refusal:
            check_feature_source("test_cached_only", "online")
        assert "\n" not in str(refusal.value) and "train=test_cached_only trains on cached features only" in str(refusal.value)
        check_feature_source("eagle3", "online")  # the control: a method that declared online=True
        with pytest.raises(ValueError, match="features='disk': choose one of cached, online"):
            check_feature_source("eagle3", "disk")
    finally:
        del METHODS._factories["test_cached_only"], METHODS._traits["test_cached_only"]


class WordTokenizer:
    """Chat template = "role: text" lines; one token per word (hashed into a 128-token vocabulary)."""

    eos_token_id = None
    chat_template = "role: text"  # what specdec-train checks a target's tokenizer for

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        return " ".join(f"{m['role']}: {m['content']}" for m in messages) + (" assistant:" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [sum(map(ord, word)) % 128 for word in text.split()]}


def test_regenerated_answers_are_the_targets_own_and_resume_after_a_kill(tmp_path):
    from drafters.training.data import answered_sequences
    from experiments.common.answers import regenerated_answers

    def regenerated_sequences(target, tokenizer, conversations, max_length, cache, **options):  # as specdec-train reads them
        return answered_sequences(regenerated_answers(target, tokenizer, conversations, max_length, cache, **options), max_length)

    target = HFTarget(tiny_model("llama", sharpness=4.0))
    conversations = [
        Conversation("a", (("user", "tell me about cats"), ("assistant", "cats are ..."), ("user", "more"))),
        Conversation("b", (("assistant", "an answer with no question"),)),  # nothing to regenerate from
        Conversation("c", (("system", "be brief"), ("user", "why is the sky blue"))),
    ]
    cache = tmp_path / "regen.jsonl"
    sequences = regenerated_sequences(target, WordTokenizer(), conversations, 64, cache, max_new_tokens=12, batch_size=1)
    tokenizer = WordTokenizer()
    prompts = [tokenizer(tokenizer.apply_chat_template(m, add_generation_prompt=True))["input_ids"]
               for m in ([{"role": "user", "content": "tell me about cats"}],
                         [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why is the sky blue"}])]
    answers = SpecDecoder(target, None, reference.verify).generate(prompts, 12, SamplingParams(0.0)).outputs
    assert sequences == [p + a for p, a in zip(prompts, answers)]
    # a kill in the middle of the second line: the rerun keeps the first, regenerates the second
    lines = cache.read_text().splitlines()
    cache.write_text(lines[0] + "\n" + lines[1][:10])
    assert regenerated_sequences(target, WordTokenizer(), conversations, 64, cache, max_new_tokens=12) == sequences
    assert cache.read_text().splitlines() == lines
    with pytest.raises(ValueError, match="opens with a usable user turn"):
        regenerated_sequences(target, WordTokenizer(), conversations[1:2], 64, cache)
    # answers cut by a smaller max_length are generated again when a larger one reads the cache
    short = tmp_path / "short.jsonl"
    cut = regenerated_sequences(target, WordTokenizer(), conversations, max(map(len, prompts)) + 3, short, max_new_tokens=12)
    assert [len(ids) for ids in cut] == [len(p) + min(12, max(map(len, prompts)) + 3 - len(p)) for p in prompts]
    assert regenerated_sequences(target, WordTokenizer(), conversations, 64, short, max_new_tokens=12) == sequences
    assert len(short.read_text().splitlines()) == 4  # the cut lines stay; the later ones win
    # sampled answers are seeded per conversation: the same whatever is decoded beside them
    sampled = [regenerated_sequences(target, WordTokenizer(), conversations, 64, tmp_path / f"sampled-{width}.jsonl",
                                     max_new_tokens=12, sampling=SamplingParams(1.0), batch_size=width) for width in (1, 2)]
    assert sampled[0] == sampled[1] and sampled[0] != sequences


def test_a_cached_answer_serves_when_it_ended_or_is_long_enough():
    from experiments.common.answers import _answer_serves

    prompt = [5, 6]
    assert _answer_serves(prompt + [1, 2, 3], prompt, 3, None) and _answer_serves(prompt + [1, 2, 3], prompt, 2, None)
    assert not _answer_serves(prompt + [1, 2], prompt, 3, None) and not _answer_serves(None, prompt, 1, None)
    assert _answer_serves(prompt + [1, 0], prompt, 9, 0)  # ended on its end-of-sequence token
    assert not _answer_serves(prompt + [0, 1], prompt, 9, 0) and not _answer_serves(prompt, prompt, 9, 0)


def test_bundled_heads_are_picked_by_the_targets_key_and_a_missing_one_names_the_command_that_trains_it():
    from drafters.heads import BUNDLED, bundled_checkpoint
    from specdec.packaged_models import cache_dir

    assert bundled_checkpoint("eagle3", "eagle3", "smollm2") == BUNDLED / "eagle3-smollm2"
    with pytest.raises(ValueError, match="train=medusa target=gemma3_270m output=drafters/checkpoints/medusa-gemma3_270m"):
        bundled_checkpoint("medusa", "medusa", "gemma3_270m")
    for other in ("hf", str(cache_dir() / "smollm2-135m-instruct")):  # a model folder, even a packaged model's converted one
        with pytest.raises(ValueError, match=f"no eagle3 head is bundled for {other}; .*specdec-train train=eagle3 target="):
            bundled_checkpoint("eagle3", "eagle3", other)


def test_a_model_without_a_chat_template_trains_as_a_base_model_on_plain_text_or_is_refused(tmp_path, monkeypatch):
    from experiments.train.sources import open_chat_target
    from specdec import target_loader
    from specdec.target_loader import TargetConfig
    from tiny_models import save_base_model

    monkeypatch.setattr(target_loader, "load_hf_target", lambda *args: pytest.fail("the weights loaded"))
    folder = save_base_model(tmp_path)
    with pytest.raises(ValueError, match=f"target.path={folder}: its tokenizer has no chat template.*target.chat=false"):
        open_chat_target(TargetConfig(name="hf", path=str(folder)))
    tokenizer = open_chat_target(TargetConfig(name="hf", path=str(folder), chat=False)).tokenizer
    conversation = Conversation("a", (("user", "hello there"), ("assistant", "  "), ("assistant", "general kenobi")))
    sequences = chat_sequences(tokenizer, [conversation], 64, min_length=4, chat=False)
    assert sequences == [tokenizer("hello there\n\ngeneral kenobi")["input_ids"]]  # blank turns left out


@pytest.mark.parametrize("settings", [
    {"name": "eagle3", "feature_layers": [1, 2], "unroll": 2, "regression_weight": 0.0, "feature_noise": 0.0},
    {"name": "mtp", "depth": 2},
    {"name": "domino", "block_size": 3, "num_anchors": 8, "gru_size": 8, "emb_dim": 8, "draft_vocab": 32},
    {"name": "medusa", "num_heads": 2, "tree_top_k": 2, "total_tokens": 4},
])
def test_init_continues_training_from_an_exported_head(tmp_path, settings):
    from drafters.training.methods import build_method

    target = HFTarget(tiny_model("llama", sharpness=4.0))
    cache = FeatureCache(make_cache(tmp_path, target, repetitive_sequences(6), layers=(1, 2, 3))[0])
    method = build_method(settings)
    torch.manual_seed(0)
    prepared = method.prepare(target, cache, 2, 0, [0, 1, 2])
    batch = next(prepared.batches(0))
    fresh = float(prepared.loss(batch)[0].detach())
    train(prepared.model, prepared.batches, prepared.loss,
          TrainConfig(steps=40, lr=1e-2, warmup_steps=3, checkpoint_every=100, log_every=10), tmp_path / "run")
    method.export(prepared.model.to(torch.float16), tmp_path / "head", {})  # as specdec-train exports

    head = method.load(target, tmp_path / "head")
    torch.manual_seed(1)  # a new head would start elsewhere: the loaded one must be used as it is
    continued = method.prepare(target, cache, 2, 0, [0, 1, 2], head)
    assert continued.model is head
    start = float(continued.loss(batch)[0].detach())
    assert start < 0.5 * fresh  # it starts where the first run ended, not from scratch

    if settings["name"] == "eagle3":
        with pytest.raises(ValueError, match=r"does not match train=eagle3.*feature_layers: checkpoint \(1, 2\), settings \(1,\)"):
            build_method({**settings, "feature_layers": [1]}).prepare(target, cache, 2, 0, [0, 1, 2], method.load(target, tmp_path / "head"))
    if settings["name"] == "mtp":
        with pytest.raises(ValueError, match="depth: checkpoint 2, settings 3"):
            build_method({"name": "mtp", "depth": 3}).prepare(target, cache, 2, 0, [0, 1, 2], method.load(target, tmp_path / "head"))


def test_medusa2_refuses_init_clearly(tmp_path):
    from drafters.training.methods import build_method

    with pytest.raises(ValueError, match="medusa2 cannot continue from an exported checkpoint"):
        build_method({"name": "medusa2"}).load(HFTarget(tiny_model("llama")), tmp_path)


def test_a_resume_that_would_rebuild_the_head_differently_is_refused(tmp_path):
    target = HFTarget(tiny_model("llama", sharpness=4.0))
    cache = FeatureCache(make_cache(tmp_path, target, repetitive_sequences(4), layers=(3,))[0])
    lm_head = target.model.get_output_embeddings().weight.detach()
    data = EagleData(cache, (3,), lm_head, 3, batch_size=2)
    config = TrainConfig(steps=4, lr=1e-3, warmup_steps=1, checkpoint_every=2, log_every=2)

    def head(rope_theta):  # the same weight shapes either way: only the saved config tells them apart
        built = EagleHead(replace(EagleConfig.for_target(target, (3,), 64), rope_theta=rope_theta), torch.arange(64))
        return built, EagleLoss(built, target.model.get_input_embeddings().weight.detach(), lm_head, EagleLossConfig())

    model, loss = head(10000.0)
    train(model, data.batches, loss, replace(config, steps=2), tmp_path / "run")
    model, loss = head(100000.0)
    with pytest.raises(ValueError, match=r"trained as a head with rope_theta=10000.0, but this run builds rope_theta=100000.0"):
        train(model, data.batches, loss, config, tmp_path / "run")
    model, loss = head(10000.0)
    assert train(model, data.batches, loss, config, tmp_path / "run") == 4


def test_eagle3s_shipped_config_fuses_the_low_middle_and_high_blocks_of_any_target():
    import yaml

    from drafters.training.methods import build_method

    options = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "train" / "eagle3.yaml").read_text())
    method = build_method(options)
    assert method.feature_layers(HFTarget(tiny_model("llama", layers=8))) == (2, 4, 5)
    assert method.feature_layers(HFTarget(tiny_model("llama", layers=12))) == (2, 6, 9)
    with pytest.raises(ValueError, match="train.feature_layers='fuse'"):
        build_method({**options, "feature_layers": "fuse"})


def test_a_native_head_with_feature_norm_reads_its_features_at_any_scale_and_saves_it(tmp_path):
    """train.feature_norm=true: an RMSNorm after the fusion, so target layers of any scale (Gemma 3's
    middle layers) enter the head as unit-scale rows; the head without it reads them raw. The
    setting travels in the checkpoint's config, and a published arch refuses it."""
    from drafters.training.methods import build_method

    target = HFTarget(tiny_model("llama", layers=8))
    torch.manual_seed(0)
    normed = EagleHead(EagleConfig.for_target(target, (2, 4, 5), 16, feature_norm=True))
    raw = EagleHead(EagleConfig.for_target(target, (2, 4, 5), 16))
    features, embeddings = torch.randn(1, 5, 3 * target.hidden_size), torch.randn(1, 5, target.hidden_size)
    with torch.no_grad():
        assert torch.allclose(normed.forward_sequence(features * 1e4, embeddings), normed.forward_sequence(features, embeddings),
                              atol=1e-4)
        assert not torch.allclose(raw.forward_sequence(features * 1e4, embeddings), raw.forward_sequence(features, embeddings),
                                  atol=1e-1)
    save_head(normed, tmp_path / "head")
    loaded = load_head(tmp_path / "head", target)
    assert loaded.config.feature_norm and torch.equal(loaded.feature_norm.weight, normed.feature_norm.weight)
    method = build_method({"name": "eagle3", "feature_layers": "fused", "feature_norm": True})
    assert method.feature_norm
    with pytest.raises(ValueError, match="train.feature_norm=true belongs to train.arch=native"):
        build_method({"name": "eagle3", "feature_layers": "fused", "arch": "eagle3", "feature_norm": True})
    with pytest.raises(ValueError, match="feature_norm belongs to arch=native heads"):
        EagleConfig.for_target(target, (2, 4, 5), 16, arch="eagle3", feature_norm=True)


def test_feature_norm_auto_turns_the_norm_on_only_for_a_target_whose_layers_are_far_from_unit_scale():
    """train.feature_norm=auto (the default) decides from the first batch's fused layers: a tiny target as
    built keeps the raw fusion; the same target with its embeddings scaled up 1e5-fold (a residual
    stream at Gemma 3's scale) gets the norm. An init= head keeps whatever it was built with under auto,
    and an explicit setting that disagrees with it is refused."""
    from drafters.training.methods import build_method
    from drafters.training.online import OnlineData, TokenSequences, online_head_data

    def prepared_head(target, head=None, norm="auto"):
        method = build_method({"name": "eagle3", "feature_layers": [1, 2, 3], "draft_vocab": 32, "feature_norm": norm})
        data = OnlineData(target, sequences, method.feature_layers(target), batch_tokens=100)
        return method.prepare_on(target, online_head_data(data, torch.arange(32)), head).model

    tokens = torch.randint(128, (60,), generator=torch.Generator().manual_seed(0))
    sequences = TokenSequences(tokens, torch.tensor([0, 25, 60]), torch.ones(60, dtype=torch.bool))
    unit = HFTarget(tiny_model("llama", layers=4))
    assert prepared_head(unit).feature_norm is None
    large = HFTarget(tiny_model("llama", layers=4))
    with torch.no_grad():
        large.model.get_input_embeddings().weight.mul_(1e5)
    normed = prepared_head(large)
    assert normed.config.feature_norm and normed.feature_norm is not None
    assert prepared_head(unit, head=normed) is normed
    with pytest.raises(ValueError, match="feature_norm: checkpoint True, settings False"):
        prepared_head(unit, head=normed, norm=False)
    with pytest.raises(ValueError, match="train.feature_norm='yes': choose true, false or auto"):
        build_method({"name": "eagle3", "feature_layers": "fused", "feature_norm": "yes"})
