"""A quantised weight read inside `held_floats.holding` is de-quantised once for any number of
forwards and backwards, gives the gradients of the float weight, stays within the byte budget,
and is dropped when the holding ends (#28: a layer's recompute and backward over every window
read each weight 2 x windows times)."""

from __future__ import annotations

import torch

from edge_runtime.model import held_floats, qweights
from edge_runtime.model.qweights import QuantWeight, quant_linear
from tests.model.test_qweights import _mixed


def _count_dequantize(monkeypatch) -> list[int]:
    calls = [0]
    original = qweights.Blocks.dequantize

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(qweights.Blocks, "dequantize", counted)
    return calls


def _two_windows(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(3, w.shape[1], generator=gen).requires_grad_(True) for _ in range(2)]
    ys = [quant_linear(x, w) for x in xs]
    torch.autograd.backward(ys, [torch.ones_like(y) for y in ys])
    return torch.cat([y.detach() for y in ys]), torch.cat([x.grad for x in xs])


def test_a_held_weight_is_de_quantised_once_and_gives_the_float_gradients(monkeypatch):
    w = _mixed()
    dense = w.dequantize()
    calls = _count_dequantize(monkeypatch)
    free_y, free_grad = _two_windows(w)
    unheld = calls[0]
    assert unheld == 4 * len(w.parts)  # two forwards and two backwards, each reading every part
    calls[0] = 0
    with held_floats.holding():
        held_y, held_grad = _two_windows(w)
    assert calls[0] == len(w.parts)  # one whole de-quantisation for all four reads
    torch.testing.assert_close(held_y, free_y, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(held_grad, free_grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(held_grad[:3], torch.ones(3, w.shape[0]) @ dense, rtol=1e-5, atol=1e-6)
    calls[0] = 0
    _two_windows(w)  # the holding ended: its copy is gone
    assert calls[0] == unheld


def test_weights_past_the_budget_are_read_their_bounded_way(monkeypatch):
    w, other = _mixed(), _mixed()
    bytes_one = w.shape.numel() * 4
    calls = _count_dequantize(monkeypatch)
    with held_floats.holding(max_bytes=bytes_one):
        _two_windows(w)
        _two_windows(other)  # does not fit beside the first: read in chunks each time
        assert held_floats.whole(w, torch.zeros(1)) is not None
        assert held_floats.whole(other, torch.zeros(1)) is None
    assert calls[0] == len(w.parts) + 4 * len(other.parts)
    assert held_floats.whole(w, torch.zeros(1)) is None  # nothing outside a holding


def test_a_backward_stage_counts_the_layer_it_holds_only_where_dropout_draws(tmp_path, monkeypatch):
    """With LoRA dropout the staged backward recomputes window by window and holds the layer:
    its estimate includes the layer's weights kept as blocks, in float32, at most the budget.
    Without (the default) every window runs in one call of the layer and nothing is held: no
    holding is entered, and the estimate counts no layer (#28)."""
    import dataclasses

    from edge_runtime.model.gguf_load import load_llama_gguf
    from edge_runtime.model.tokenizer import Tokenizer
    from edge_runtime.train.staged import StageKind
    from tests.model.quant_helpers import Q4_K_M_LIKE, tiny_quant_gguf
    from tests.train.helpers import make_trainer, preference_records

    folder, path = tiny_quant_gguf(tmp_path, Q4_K_M_LIKE)
    model = load_llama_gguf(path)
    layer = max(sum(m.shape.numel() for m in block.modules() if isinstance(m, QuantWeight)) for block in model.layers)
    assert layer > 0 and held_floats.layer_bytes(model, QuantWeight) == 4 * layer
    trainer = make_trainer(model, Tokenizer(folder))
    task = trainer.task(preference_records()[0], score=False)
    start, stop = task.groups[-1]
    plain = task.costs.backward_group(task.tokens.num_rows, stop - start, 0, len(task.windows), True)
    backward = next(s for s in task.stages if s.kind is StageKind.BACKWARD)
    assert backward.estimate().peak_bytes == plain.peak_bytes

    def refused(*args, **kwargs):
        raise AssertionError("nothing is held without dropout")
    with monkeypatch.context() as m:
        m.setattr(held_floats, "holding", refused)
        while task.next_stage().kind is not StageKind.OPTIMIZER:
            task.run_next()
    trainer.release(task)
    trainer.weights.settings = dataclasses.replace(trainer.weights.settings, dropout=0.3)
    task = trainer.task(preference_records()[0], score=False)
    backward = next(s for s in task.stages if s.kind is StageKind.BACKWARD)
    assert backward.estimate().peak_bytes == plain.peak_bytes + 4 * layer
    monkeypatch.setattr(held_floats, "MAX_BYTES", 1000)
    assert held_floats.layer_bytes(model, QuantWeight) == 1000


def test_holdings_inside_an_arena_write_into_it_and_read_the_same(monkeypatch):
    w, other = _mixed(), _mixed()
    free_y, free_grad = _two_windows(w)
    with held_floats.arena(4 * w.shape.numel()):
        for _ in range(2):  # one layer after another reuses the one buffer
            with held_floats.holding():
                held_y, held_grad = _two_windows(w)
                copy = held_floats.whole(w, torch.zeros(1))
                assert copy.data_ptr() == held_floats._LOCAL.arena.data_ptr()
                assert torch.equal(copy, w.dequantize())
                assert held_floats.whole(other, torch.zeros(1)).data_ptr() != copy.data_ptr()  # no room: its own
            torch.testing.assert_close(held_y, free_y, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(held_grad, free_grad, rtol=1e-5, atol=1e-6)
    assert getattr(held_floats._LOCAL, "arena", None) is None
