"""The load-or-recompute planner (kvpool/integrations/planner.py) on synthetic links and engines."""

from __future__ import annotations

import pytest

from kvpool.integrations.planner import Planner

MB = 1_000_000
BLOCK_TOKENS = 128


def test_it_fits_alpha_and_beta_from_pulls_of_several_sizes() -> None:
    planner = Planner()
    for nbytes in (1 * MB, 2 * MB, 4 * MB, 8 * MB, 16 * MB):  # 2 ms per request + 2 GB/s
        planner.observe_pull(nbytes, 2e-3 + nbytes / 2e9)
    assert planner.alpha_s == pytest.approx(2e-3, rel=1e-6)
    assert planner.beta_bytes_per_s == pytest.approx(2e9, rel=1e-6)
    assert planner.transfer_s(10, MB, rounds=4) == pytest.approx(4 * 2e-3 + 10 * MB / 2e9)


def test_pulls_of_one_size_refine_beta_and_keep_alpha() -> None:
    planner = Planner(alpha_s=1e-3)
    for _ in range(5):
        planner.observe_pull(4 * MB, 1e-3 + 4 * MB / 1e9)
    assert planner.alpha_s == 1e-3 and planner.beta_bytes_per_s == pytest.approx(1e9, rel=1e-6)


def test_loading_wins_until_the_engine_is_measured_then_the_faster_side_wins() -> None:
    planner = Planner(alpha_s=1e-3, beta_bytes_per_s=1e9)
    assert planner.recompute_s(3, BLOCK_TOKENS) is None
    assert planner.blocks_to_load(3, 4 * MB, BLOCK_TOKENS, rounds=8) == 3  # nothing measured: load
    planner.observe_prefill(4096, 1.0)  # a slow engine: 4k tokens/s -> 96 ms for 3 blocks
    # 8 rounds x 1 ms + 12 MB at 1 GB/s = 20 ms < 96 ms: load
    assert planner.blocks_to_load(3, 4 * MB, BLOCK_TOKENS, rounds=8) == 3
    fast = Planner(alpha_s=1e-3, beta_bytes_per_s=1e9)
    fast.observe_prefill(1_000_000, 1.0)  # a fast engine: 1M tokens/s -> 0.4 ms for 3 blocks
    assert fast.blocks_to_load(3, 4 * MB, BLOCK_TOKENS, rounds=8) == 0  # recompute
    # A slow link turns the slow engine's decision around too.
    slow_link = Planner(alpha_s=50e-3, beta_bytes_per_s=0.1e9)
    slow_link.observe_prefill(4096, 1.0)
    assert slow_link.blocks_to_load(3, 4 * MB, BLOCK_TOKENS, rounds=8) == 0
    # The fixed cost is paid once per load: enough blocks make loading worth it again.
    middle = Planner(alpha_s=20e-3, beta_bytes_per_s=1e9)
    middle.observe_prefill(10_000, 1.0)  # 12.8 ms per block
    assert middle.blocks_to_load(1, 4 * MB, BLOCK_TOKENS, rounds=8) == 0   # 164 ms vs 12.8 ms
    assert middle.blocks_to_load(64, 4 * MB, BLOCK_TOKENS, rounds=8) == 64  # 416 ms vs 819 ms


def test_bad_samples_are_ignored_and_the_window_is_bounded() -> None:
    planner = Planner(window=8)
    planner.observe_pull(0, 1.0)
    planner.observe_pull(MB, 0)
    planner.observe_prefill(-1, 1.0)
    assert (planner.alpha_s, planner.beta_bytes_per_s, planner.prefill_tokens_per_s) == (0.5e-3, 1e9, 0.0)
    for i in range(100):
        planner.observe_prefill(1000, 1.0 if i < 92 else 0.5)  # the last 8 samples only
    assert planner.prefill_tokens_per_s == pytest.approx(2000)
    assert planner.blocks_to_load(0, MB, BLOCK_TOKENS) == 0
