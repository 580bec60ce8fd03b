"""PrefillRunner: cached KV blocks are the model's own KV; reusing them gives the same logits."""

from __future__ import annotations

import pytest
import torch

from kvtier.block import Block
from kvtier.engine.models import model_spec
from kvtier.engine.prefill import PrefillRunner
from kvtier.errors import LayoutMismatch
from kvtier.keys import Segment, block_chain
from tests.helpers import DERIVER, SMALL

TOL = 1e-4  # float32 twins: different matmul shapes only reorder sums


@pytest.fixture(scope="module")
def runner() -> PrefillRunner:
    spec = model_spec("tiny").with_dtype("float32")
    return PrefillRunner(spec.build(0), spec.layout())


@pytest.fixture(scope="module")
def tokens(runner: PrefillRunner) -> torch.Tensor:
    return torch.randint(0, runner.vocab_size, (200,), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def full(runner: PrefillRunner, tokens: torch.Tensor):
    return runner.prefill(tokens)


def test_only_full_blocks_are_returned(runner: PrefillRunner, full) -> None:
    bt = runner.layout.block_tokens
    assert len(full.new_blocks) == 200 // bt
    assert all(tuple(b.shape) == runner.layout.block_shape for b in full.new_blocks)
    assert full.logits_last.shape == (runner.vocab_size,) and full.logits_last.dtype == torch.float32


def test_reload_prefix_gives_same_logits_and_blocks(runner: PrefillRunner, tokens, full) -> None:
    front = runner.prefill(tokens[:128])
    rest = runner.prefill(tokens[128:], past_blocks=front.new_blocks)
    torch.testing.assert_close(rest.logits_last, full.logits_last, atol=TOL, rtol=0)
    for a, b in zip(front.new_blocks + rest.new_blocks, full.new_blocks, strict=True):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)


def test_front_computed_back_loaded_meet_in_the_middle(runner: PrefillRunner, tokens, full) -> None:
    """Pipelined plan: compute blocks 0..3 now, take 4..7 from an earlier run, then the question."""
    front = runner.prefill(tokens[:64])
    past = front.new_blocks + full.new_blocks[4:8]
    out = runner.prefill(tokens[128:], past_blocks=past)
    torch.testing.assert_close(out.logits_last, full.logits_last, atol=TOL, rtol=0)


def test_kv_of_other_tokens_changes_the_logits(runner: PrefillRunner, tokens, full) -> None:
    """Negative control: the equality above would catch a wrong prefix."""
    other = runner.prefill((tokens[:128] + 1) % runner.vocab_size)
    mixed = full.new_blocks[:4] + other.new_blocks[4:8]
    out = runner.prefill(tokens[128:], past_blocks=mixed)
    assert (out.logits_last - full.logits_last).abs().max() > 100 * TOL


def test_blocks_cache_roundtrip_is_exact(runner: PrefillRunner, full) -> None:
    cache = runner.cache_from_blocks(full.new_blocks[:5])
    assert cache.get_seq_length() == 5 * runner.layout.block_tokens
    back = runner.blocks_from_cache(cache, 0, 5 * runner.layout.block_tokens)
    for a, b in zip(back, full.new_blocks[:5], strict=True):
        assert torch.equal(a, b)


def test_kvtier_blocks_accepted_as_past(runner: PrefillRunner, tokens, full) -> None:
    lay = runner.layout
    chain = block_chain(lay, [Segment(tokens[:128].tolist())], DERIVER)
    blocks = [Block.build(lay, c.key, c.domain, d, parent=c.parent, index=c.index)
              for c, d in zip(chain, full.new_blocks[:8], strict=True)]
    out = runner.prefill(tokens[128:], past_blocks=blocks)
    torch.testing.assert_close(out.logits_last, full.logits_last, atol=TOL, rtol=0)


def test_bfloat16_default_model_reuse_is_close() -> None:
    spec = model_spec("tiny")
    run = PrefillRunner(spec.build(0), spec.layout())
    toks = torch.randint(0, spec.vocab_size, (96,), generator=torch.Generator().manual_seed(2))
    whole = run.prefill(toks)
    part = run.prefill(toks[64:], past_blocks=run.prefill(toks[:64]).new_blocks)
    torch.testing.assert_close(part.logits_last, whole.logits_last, atol=0.1, rtol=0.02)


def test_extract_false_returns_no_blocks(runner: PrefillRunner, tokens) -> None:
    out = runner.prefill(tokens[:40], extract=False)
    assert out.new_blocks == [] and out.timing.extract_s < 1.0


# -- bad input: a clear error, nothing computed ---------------------------------------------------
@pytest.mark.parametrize(
    ("toks", "match"),
    [
        ([], "at least one token"),
        ([[1, 2], [3, 4]], "1-D"),
        ([1, -1], r"\[0, "),
        ([1, 10**6], r"\[0, "),
    ],
)
def test_bad_tokens_rejected(runner: PrefillRunner, toks, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        runner.prefill(toks)


def test_too_many_positions_rejected(runner: PrefillRunner) -> None:
    with pytest.raises(ValueError, match="exceed"):
        runner.prefill([1] * (runner.max_positions + 1))


def test_past_block_of_wrong_shape_or_dtype_rejected(runner: PrefillRunner, full) -> None:
    good = full.new_blocks[0]
    with pytest.raises(LayoutMismatch, match="past block 1"):
        runner.prefill([1, 2], past_blocks=[good, good[:, :, :8].contiguous()])
    with pytest.raises(LayoutMismatch, match="past block 0"):
        runner.prefill([1, 2], past_blocks=[good.to(torch.bfloat16)])


def test_block_of_another_layout_rejected(runner: PrefillRunner) -> None:
    foreign = block_chain(SMALL, [Segment(list(range(SMALL.block_tokens)))], DERIVER)[0]
    blk = Block.build(SMALL, foreign.key, foreign.domain, SMALL.empty_block().zero_())
    with pytest.raises(LayoutMismatch):
        runner.prefill([1, 2], past_blocks=[blk])


def test_layout_must_match_model(runner: PrefillRunner) -> None:
    with pytest.raises(LayoutMismatch, match="does not match the model"):
        PrefillRunner(runner.model, model_spec("small").with_dtype("float32").layout())
    with pytest.raises(LayoutMismatch):
        PrefillRunner(runner.model, model_spec("tiny").layout())  # bf16 layout, float32 model


def test_block_extraction_must_be_aligned(runner: PrefillRunner, full) -> None:
    cache = runner.cache_from_blocks(full.new_blocks[:2])
    with pytest.raises(ValueError, match="block boundary"):
        runner.blocks_from_cache(cache, 3, 32)


def test_loaded_blocks_reach_the_models_device_through_the_transfer_engine(runner: PrefillRunner, full) -> None:
    """Whatever the model's device is (CUDA when present, else the CPU), reloaded blocks land there,
    byte for byte, moved by the transfer engine (its staging was used)."""
    blocks = full.new_blocks[:3]
    moved = runner.to_device(blocks)
    assert moved.device == runner.device == next(runner.model.parameters()).device
    assert all(torch.equal(m.cpu(), b) for m, b in zip(moved, blocks, strict=True))
    assert runner._engine is not None, "the blocks went through the transfer engine"
