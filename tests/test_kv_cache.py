"""GrowingLayer keeps DynamicLayer's semantics (what attention sees, crop, assignment, batch
selection) while appending in place."""

import torch
from transformers import DynamicCache

from specdec.kv_cache import GrowingLayer, growing_cache


def _kv(batch: int, columns: int, seed: int) -> torch.Tensor:  # [B, H, C, D]
    return torch.randn(batch, 3, columns, 8, generator=torch.Generator().manual_seed(seed))


def test_appends_match_concatenation_and_reuse_the_buffer():
    layer, reference = GrowingLayer(), []
    first = _kv(2, 5, 0)
    keys, values = layer.update(first, -first)
    reference.append(first)
    buffer = keys.data_ptr()
    for seed in range(1, 4):  # 3 more columns each: within the spare room of the first buffer
        new = _kv(2, 1, seed)
        keys, values = layer.update(new, -new)
        reference.append(new)
        assert keys.data_ptr() == buffer, "an append within capacity must not copy the cache"
    expected = torch.cat(reference, dim=2)
    assert torch.equal(keys, expected) and torch.equal(values, -expected)
    assert layer.get_seq_length() == 8 and torch.equal(layer.keys, expected)


def test_growth_keeps_every_column():
    layer, reference = GrowingLayer(), []
    for seed in range(40):  # from 2 columns to 80: several reallocations
        new = _kv(1, 2, seed)
        keys, _ = layer.update(new, new)
        reference.append(new)
    assert torch.equal(keys, torch.cat(reference, dim=2))


def test_crop_and_prefix_restore_only_move_the_length():
    layer = GrowingLayer()
    keys, _ = layer.update(_kv(2, 6, 0), _kv(2, 6, 1))
    saved = layer.keys[:, :, :4]
    layer.crop(0)
    assert layer.get_seq_length() == 6
    layer.crop(-2)  # transformers 5.24's sign: remove 2 columns
    assert layer.get_seq_length() == 4 and layer.keys.data_ptr() == keys.data_ptr()
    assert torch.equal(layer.values, _kv(2, 6, 1)[:, :, :4])
    layer.update(_kv(2, 3, 2), _kv(2, 3, 3))  # draft rows written past column 4
    layer.keys = saved  # what a layer-skip drafter does to drop them
    assert layer.get_seq_length() == 4 and torch.equal(layer.keys, keys[:, :, :4])


def test_assigning_another_tensor_copies_it():
    layer = GrowingLayer()
    original = _kv(3, 4, 0)
    layer.update(original, original)
    rows = torch.tensor([2, 0])
    layer.keys, layer.values = layer.keys[rows], layer.values[rows]  # HFTarget.retain
    assert torch.equal(layer.keys, original[rows]) and layer.get_seq_length() == 4
    new = _kv(2, 1, 1)
    keys, _ = layer.update(new, new)
    assert torch.equal(keys, torch.cat([original[rows], new], dim=2))


def test_a_model_sees_the_same_cache_as_with_dynamic_layers():
    import inspect

    from tests.tiny_models import tiny_model

    model = tiny_model("llama").eval()
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name, cache in (("dynamic", DynamicCache()), ("growing", growing_cache())):
        with torch.no_grad():
            model(input_ids=ids[:, :5], use_cache=True, **{arg: cache})
            cache.crop(-1)
            out = [model(input_ids=ids[:, i : i + 1], use_cache=True, **{arg: cache}).logits for i in range(4, 9)]
        logits[name] = torch.cat(out, dim=1)
        assert cache.get_seq_length() == 9
    assert isinstance(cache.layers[0], GrowingLayer)
    torch.testing.assert_close(logits["growing"], logits["dynamic"], rtol=0, atol=1e-5)
