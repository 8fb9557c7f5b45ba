import json
import math
import random
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from klpipe.errors import InputError, StateError
from klpipe.score.controller import ControllerConfig, KLController, KLStats
from tests.helpers import seed_config, seed_controller

KL = st.floats(min_value=0, max_value=20, allow_nan=False)
BATCHES = st.lists(st.lists(KL, max_size=12), max_size=25)
CONFIGS = st.fixed_dictionaries(
    {
        "kl_coeff": st.floats(0.01, 1.0),
        "kl_target": st.floats(0.1, 8.0),
        "window": st.integers(1, 30),
        "increase_factor": st.floats(1.0, 3.0),
        "decrease_factor": st.floats(0.1, 1.0),
        "adaptive": st.booleans(),
    }
)


def seed_state_view(controller) -> dict:
    """The seed's save_state keys, which our state must reproduce value for value."""
    state = controller.save_state()
    return {key: state[key] for key in ("kl_coeff", "adaptation_count", "samples_processed")} | {
        "recent_history": state["recent_history"][-100:]
    }


# -- replay against the seed ------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(config=CONFIGS, batches=BATCHES, per_sample=st.lists(st.booleans(), min_size=25, max_size=25))
def test_replay_matches_the_seed_exactly(config, batches, per_sample):
    """Any per-row KLs, fed as batches or one sample at a time: identical numbers, bit for bit.

    A one-token row with policy = kl and ref = 0 makes the seed see exactly the KL we feed ours.
    """
    ours = KLController(ControllerConfig(**config))
    seed = seed_controller(**seed_config(**config))
    for batch, one_by_one in zip(batches, per_sample[: len(batches)], strict=True):
        if one_by_one:
            for kl in batch:
                seed_penalty, seed_kl = seed.get_penalty_from_logprobs([kl], [0.0])
                assert ours.penalise_sample(kl) == seed_penalty
                assert seed_kl == kl
        else:
            seed_penalties, seed_stats = seed.get_batch_penalty_from_logprobs(
                [[kl] for kl in batch], [[0.0]] * len(batch)
            )
            penalties, stats = ours.penalise_batch(batch)
            assert penalties == seed_penalties
            if batch:  # the seed drops its counters from empty-batch stats; see test_empty_stats_keep_counters
                assert stats == KLStats(**vars(seed_stats))
                assert stats.to_dict() == seed_stats.to_dict()
        assert ours.kl_coeff == seed.kl_coeff
        assert seed_state_view(ours) == seed.save_state() | {
            "recent_history": seed.save_state()["recent_history"][-100:]
        }
        if ours.get_stats().samples_processed and seed._kl_history:
            assert ours.get_stats() == KLStats(**vars(seed.get_stats()))


def test_replay_through_logprobs_matches_the_seed():
    """The logprob methods, multi-token rows: dyadic logprobs make every sum exact on both sides."""
    rng = random.Random(7)
    ours = KLController(ControllerConfig(kl_target=0.5, window=4))
    seed = seed_controller(kl_target=0.5, adaptation_window=4)
    coefficients = []
    for step in range(40):
        rows = rng.randint(0, 5)
        policy = [[-rng.randint(0, 200) / 64 for _ in range(rng.randint(0, 7))] for _ in range(rows)]
        ref = [[p - rng.randint(-20, 120) / 64 for p in row] for row in policy]
        if step % 3 == 0 and rows:
            assert ours.get_penalty_from_logprobs(policy[0], ref[0]) == seed.get_penalty_from_logprobs(
                policy[0], ref[0]
            )
        else:
            penalties, stats = ours.get_batch_penalty_from_logprobs(policy, ref)
            seed_penalties, seed_stats = seed.get_batch_penalty_from_logprobs(policy, ref)
            assert penalties == seed_penalties
            if rows:
                assert stats.to_dict() == seed_stats.to_dict()
        assert ours.kl_coeff == seed.kl_coeff
        coefficients.append(ours.kl_coeff)
    assert len(set(coefficients)) > 3  # the data really moves the coefficient both ways


def test_seed_checkpoint_loads_and_continues_identically():
    seed = seed_controller()
    for kls in ([5.0] * 12, [9.0, 8.0], [0.1] * 30):
        seed.get_batch_penalty_from_logprobs([[k] for k in kls], [[0.0]] * len(kls))
    ours = KLController()
    ours.load_state(json.loads(json.dumps(seed.save_state())))  # no "config": a seed checkpoint
    for kls in ([0.2] * 7, [6.0] * 3, [4.0] * 11):
        penalties, _ = ours.penalise_batch(kls)
        seed_penalties, _ = seed.get_batch_penalty_from_logprobs([[k] for k in kls], [[0.0]] * len(kls))
        assert penalties == seed_penalties and ours.kl_coeff == seed.kl_coeff


def test_empty_stats_keep_counters():
    # Divergence from the seed, on purpose: it reports 0 processed samples once its history is empty.
    controller = KLController(ControllerConfig(window=2))
    controller.penalise_batch([10.0, 10.0, 10.0])
    controller.reset_history()
    assert controller.get_stats() == KLStats(current_coeff=0.15000000000000002, adaptation_count=1, samples_processed=3)


# -- the rules --------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    batches=BATCHES,
    config=CONFIGS,
    kind=st.sampled_from(["window", "proportional"]),
    horizon=st.integers(1, 20000),
    bounds=st.tuples(st.floats(0.001, 0.5), st.floats(0.5, 5.0)),
)
def test_coefficient_stays_in_bounds_and_penalty_is_coeff_times_kl(batches, config, kind, horizon, bounds):
    low, high = bounds
    controller = KLController(
        ControllerConfig(**config, controller=kind, horizon=horizon, kl_coeff_min=low, kl_coeff_max=high)
    )
    config_coeff = config["kl_coeff"]
    for batch in batches:
        before = controller.kl_coeff
        penalties, _ = controller.penalise_batch(batch)
        assert penalties == [before * kl for kl in batch]
        if controller.kl_coeff != config_coeff or (kind == "proportional" and batch and config["adaptive"]):
            assert low <= controller.kl_coeff <= high


@settings(max_examples=80, deadline=None)
@given(
    batches=st.lists(st.lists(KL, min_size=1, max_size=12), max_size=25),
    target=st.floats(0.1, 8.0),
    horizon=st.integers(1, 20000),
    start=st.floats(0.01, 1.0),
)
def test_proportional_rule_matches_its_formula(batches, target, horizon, start):
    controller = KLController(
        ControllerConfig(controller="proportional", kl_target=target, horizon=horizon, kl_coeff=start)
    )
    expected = start
    for batch in batches:
        controller.penalise_batch(batch)
        error = min(max(sum(batch) / len(batch) / target - 1, -0.2), 0.2)
        expected = min(1.0, max(0.01, expected * (1 + error * len(batch) / horizon)))
        assert controller.kl_coeff == expected


def test_proportional_example_by_hand():
    controller = KLController(ControllerConfig(controller="proportional", kl_target=2.0, horizon=100, kl_coeff=0.1))
    controller.penalise_batch([3.0] * 10)  # e = 3/2 - 1 = 0.5, clipped to 0.2: × (1 + 0.2·10/100)
    assert controller.kl_coeff == pytest.approx(0.102)
    controller.penalise_batch([1.8] * 50)  # e = -0.1: × (1 - 0.1·50/100)
    assert controller.kl_coeff == pytest.approx(0.102 * 0.95)
    assert controller.adaptation_count == 2


def test_window_rule_by_hand():
    controller = KLController(ControllerConfig(window=3, kl_target=2.0))
    controller.penalise_batch([10.0, 10.0])  # only 2 in history: no decision yet
    assert controller.kl_coeff == 0.1
    controller.penalise_batch([10.0])  # mean 10 > 3: × 1.5
    assert controller.kl_coeff == pytest.approx(0.15)
    controller.penalise_batch([0.0, 0.0, 0.0])  # mean 0 < 1: × 0.8
    assert controller.kl_coeff == pytest.approx(0.12)
    controller.penalise_batch([2.0, 2.0, 2.0])  # inside the band: unchanged, not counted
    assert (controller.kl_coeff, controller.adaptation_count) == (pytest.approx(0.12), 2)


@pytest.mark.parametrize(
    "config", [ControllerConfig(controller="fixed"), ControllerConfig(adaptive=False, controller="proportional")]
)
def test_fixed_never_moves(config):
    controller = KLController(config)
    for kls in ([100.0] * 20, [0.0] * 20):
        controller.penalise_batch(kls)
    assert controller.kl_coeff == 0.1 and controller.adaptation_count == 0 and controller.samples_processed == 40


# -- β = 0 and no lower clamp -----------------------------------------------------------------------


def feed_both(ours, seed, batches):
    """The same batches to klpipe's controller and the seed's; every penalty and coefficient must agree."""
    coefficients = []
    for batch in batches:
        penalties, _ = ours.penalise_batch(batch)
        seed_penalties, _ = seed.get_batch_penalty_from_logprobs([[kl] for kl in batch], [[0.0]] * len(batch))
        assert penalties == seed_penalties and ours.kl_coeff == seed.kl_coeff
        assert ours.adaptation_count == seed._adaptation_count
        coefficients.append(ours.kl_coeff)
    return coefficients


@settings(max_examples=60, deadline=None)
@given(config=CONFIGS, batches=BATCHES, start_at_zero=st.booleans())
def test_no_lower_clamp_and_beta_zero_match_the_seed(config, batches, start_at_zero):
    """kl_coeff_min = 0 (and a start at 0 with it), where the seed accepts them: identical numbers."""
    config = {**config, "kl_coeff_min": 0.0} | ({"kl_coeff": 0.0} if start_at_zero else {})
    ours, seed = KLController(ControllerConfig(**config)), seed_controller(**seed_config(**config))
    coefficients = feed_both(ours, seed, batches)
    if start_at_zero:
        assert set(coefficients) <= {0.0}


def test_without_a_lower_clamp_the_window_rule_goes_below_the_old_minimum():
    config = {"kl_coeff": 0.04, "kl_coeff_min": 0.0, "window": 1, "decrease_factor": 0.5}
    coefficients = feed_both(KLController(ControllerConfig(**config)), seed_controller(**seed_config(**config)),
                             [[0.0]] * 6)
    assert coefficients == [0.02, 0.01, 0.005, 0.0025, 0.00125, 0.000625]
    clamped = KLController(ControllerConfig(**{**config, "kl_coeff_min": 0.01}))
    for _ in range(6):
        clamped.penalise_batch([0.0])
    assert clamped.kl_coeff == 0.01


@pytest.mark.parametrize("kind", ["window", "proportional"])
def test_beta_zero_stays_zero_whatever_the_lower_clamp(kind):
    # Departure from the seed, on purpose: with β = 0 and its default kl_coeff_min 0.01, the seed's
    # window rule lifts the coefficient to 0.01 as soon as its window fills, penalising KL the user
    # chose only to monitor. klpipe keeps it at 0 under every rule.
    ours = KLController(ControllerConfig(kl_coeff=0.0, window=2, controller=kind, horizon=10))
    for kls in ([9.0, 9.0], [0.0] * 30, [50.0] * 5):
        penalties, stats = ours.penalise_batch(kls)
        assert penalties == [0.0] * len(kls) and stats.current_coeff == 0.0
    assert (ours.kl_coeff, ours.adaptation_count, ours.samples_processed) == (0.0, 0, 37)
    assert ours.get_stats().max_kl == 50.0  # KL is still measured

    seed = seed_controller(kl_coeff=0.0, adaptation_window=2)
    seed.get_batch_penalty_from_logprobs([[9.0], [9.0]], [[0.0], [0.0]])
    assert seed.kl_coeff == 0.01


def test_a_coefficient_that_reaches_zero_stays_zero():
    # 100 rows at KL 0 with horizon 10: × (1 − 0.2·100/10) = × −1, clamped to the lower bound.
    config = {"controller": "proportional", "kl_coeff": 0.5, "kl_target": 1.0, "horizon": 10}
    unclamped = KLController(ControllerConfig(**config, kl_coeff_min=0.0))
    unclamped.penalise_batch([0.0] * 100)
    assert (unclamped.kl_coeff, unclamped.adaptation_count) == (0.0, 1)
    unclamped.penalise_batch([5.0] * 100)  # KL far above target: a multiplicative rule cannot leave 0
    assert (unclamped.kl_coeff, unclamped.adaptation_count) == (0.0, 1)
    clamped = KLController(ControllerConfig(**config))
    clamped.penalise_batch([0.0] * 100)
    clamped.penalise_batch([5.0] * 100)  # from the clamp at 0.01 it grows again: × (1 + 0.2·100/10)
    assert clamped.kl_coeff == pytest.approx(0.03)


def test_per_sample_penalty_uses_the_coefficient_after_adapting():
    controller = KLController(ControllerConfig(window=1))
    assert controller.penalise_sample(10.0) == pytest.approx(0.15 * 10.0)
    batch_controller = KLController(ControllerConfig(window=1))
    assert batch_controller.penalise_batch([10.0])[0] == [pytest.approx(0.1 * 10.0)]


# -- state ------------------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(
    batches=BATCHES,
    split=st.integers(0, 25),
    kind=st.sampled_from(["window", "proportional"]),
    window=st.integers(1, 150),
)
def test_split_runs_through_json_state_equal_one_run(batches, split, kind, window):
    config = ControllerConfig(controller=kind, window=window, kl_target=2.0)
    whole = KLController(config)
    whole_penalties = [whole.penalise_batch(batch)[0] for batch in batches]

    first = KLController(config)
    penalties = [first.penalise_batch(batch)[0] for batch in batches[:split]]
    second = KLController(config)
    second.load_state(json.loads(json.dumps(first.save_state())))
    penalties += [second.penalise_batch(batch)[0] for batch in batches[split:]]

    assert penalties == whole_penalties
    assert second.save_state() == whole.save_state()
    assert second.get_stats() == whole.get_stats()


def test_state_records_its_config_and_keeps_enough_history():
    controller = KLController(ControllerConfig(window=150))
    controller.penalise_batch([1.0] * 200)
    state = controller.save_state()
    assert state["config"]["window"] == 150 and state["config"]["controller"] == "window"
    assert len(state["recent_history"]) == 150
    assert len(KLController().save_state()["recent_history"]) == 0


@pytest.mark.parametrize(
    "other, message",
    [
        (
            ControllerConfig(controller="proportional"),
            ("state was made with the window controller and kl_target 3.0, "
             "this run uses the proportional controller and kl_target 3.0"),
        ),
        (
            ControllerConfig(kl_target=2.5),
            ("state was made with the window controller and kl_target 3.0, "
             "this run uses the window controller and kl_target 2.5"),
        ),
        (
            ControllerConfig(adaptive=False),
            ("state was made with the window controller and kl_target 3.0, "
             "this run uses the fixed controller and kl_target 3.0"),
        ),
    ],
)
def test_state_from_another_controller_or_target_is_refused(other, message):
    state = KLController().save_state()
    with pytest.raises(StateError) as excinfo:
        KLController(other).load_state(state)
    assert str(excinfo.value) == message


def test_other_config_changes_are_listed_not_refused():
    state = KLController(ControllerConfig(window=5, kl_coeff=0.5)).save_state()
    controller = KLController(ControllerConfig(window=7))
    controller.load_state(state)
    assert controller.kl_coeff == 0.5
    assert controller.config_differences(state["config"]) == ["window 5 → 7"]


@pytest.mark.parametrize(
    "state, message",
    [
        ({"kl_coeff": "high"}, "state kl_coeff must be a finite number, got 'high'"),
        ({"kl_coeff": -0.5}, "state kl_coeff must be a non-negative number, got -0.5"),
        ({"kl_coeff": 0.1, "recent_history": [1.0, None]}, "state recent_history must be a list of finite numbers"),
        ({"adaptation_count": -1}, "state adaptation_count must be a non-negative integer, got -1"),
        ({"format": "klpipe-kl-state", "version": 99}, "unsupported state format 'klpipe-kl-state' version 99"),
        ([], "controller state must be a JSON object"),
    ],
)
def test_corrupt_state_is_refused(state, message):
    with pytest.raises(StateError) as excinfo:
        KLController().load_state(state)
    assert str(excinfo.value) == message


def test_reset_history_keeps_coefficient_and_counters():
    controller = KLController(ControllerConfig(window=2))
    controller.penalise_batch([10.0, 10.0])
    controller.reset_history()
    controller.penalise_batch([10.0])  # one value in history again: below the window, no decision
    assert controller.kl_coeff == pytest.approx(0.15) and controller.samples_processed == 3


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"kl_coeff_min": 0.5, "kl_coeff_max": 0.1}, "kl_coeff_min 0.5 is above kl_coeff_max 0.1"),
        ({"kl_target": 0.0}, "kl_target must be a positive number, got 0.0"),
        ({"window": 0}, "window must be a positive number, got 0"),
        ({"horizon": -5}, "horizon must be a positive number, got -5"),
        ({"kl_coeff": math.nan}, "kl_coeff must be a non-negative number, got nan"),
        ({"kl_coeff": -0.1}, "kl_coeff must be a non-negative number, got -0.1"),
        ({"kl_coeff_min": -1e-9}, "kl_coeff_min must be a non-negative number, got -1e-09"),
        ({"kl_coeff_max": 0.0}, "kl_coeff_max must be a positive number, got 0.0"),
        ({"controller": "pid"}, "unknown controller 'pid'; choose one of window, proportional, fixed"),
    ],
)
def test_bad_config_is_refused(fields, message):
    with pytest.raises(InputError) as excinfo:
        ControllerConfig(**fields)
    assert str(excinfo.value) == message


def test_stats_to_dict_uses_the_seed_keys_and_rounding():
    stats = KLStats(
        mean_kl=1.234567,
        max_kl=2.0,
        min_kl=0.1,
        std_kl=0.33333,
        current_coeff=0.0512,
        adaptation_count=3,
        samples_processed=40,
    )
    assert stats.to_dict() == {
        "kl/mean": 1.2346,
        "kl/max": 2.0,
        "kl/min": 0.1,
        "kl/std": 0.3333,
        "kl/coeff": 0.0512,
        "kl/adaptation_count": 3,
        "kl/samples_processed": 40,
    }


def test_window_mean_is_the_builtin_sum_like_the_seed():
    # Unclamped k1 can be negative. Python ≤ 3.11 sums left to right, where 1e16 + 1 rounds back to
    # 1e16: the window mean is 0, below 0.5×target, so the coefficient drops; an exact sum gives 1/3,
    # inside the band. The seed uses the builtin sum, so klpipe must too, on whichever Python runs.
    # (The seed's logprob path clamps KLs at 0, so this case cannot be driven through the seed itself.)
    kls = [1e16, 1.0, -1e16]
    seeds_mean = sum(kls) / len(kls)
    controller = KLController(ControllerConfig(window=3, kl_target=0.5))
    controller.penalise_batch(kls)
    assert controller.kl_coeff == (0.1 * 0.8 if seeds_mean < 0.25 else 0.1)
    if sys.version_info < (3, 12):
        assert controller.kl_coeff == 0.1 * 0.8


# -- the rule pinned by figures worked out by hand (no seed needed) ---------------------------------


def test_window_rule_worked_example_with_both_clamps():
    """window 3, target 2 (band 1..3), factors 1.5 / 0.8, clamp [0.01, 1.0], start 0.1; worked by hand."""
    controller = KLController(ControllerConfig(window=3, kl_target=2.0))
    steps = [
        # (batch KLs, penalties at the coefficient in force before the batch, coefficient after, adaptations)
        ([4.0, 4.0], [0.4, 0.4], 0.1, 0),  # 2 KLs in the history: no decision yet, not even a clamp
        ([5.0], [0.5], 0.15, 1),  # last 3 = 4, 4, 5: mean 4.33 > 3 → × 1.5
        ([0.5, 0.5, 0.5], [0.075] * 3, 0.12, 2),  # mean 0.5 < 1 → 0.15 × 0.8
        ([2.0, 2.0, 2.0], [0.24] * 3, 0.12, 2),  # mean 2, inside the band: unchanged, not counted
        ([3.0, 3.0, 3.0], [0.36] * 3, 0.12, 2),  # mean 3 is not above 1.5 × target: unchanged
        ([100.0], [12.0], 0.18, 3),  # last 3 = 3, 3, 100: mean 35.3 → × 1.5
        ([100.0], [18.0], 0.27, 4),
        ([100.0], [27.0], 0.405, 5),
        ([100.0], [40.5], 0.6075, 6),
        ([100.0], [60.75], 0.91125, 7),
        ([100.0], [91.125], 1.0, 8),  # 1.366875 clamped to kl_coeff_max
        ([100.0], [100.0], 1.0, 8),  # 1.5 clamped back to 1.0: no change, not counted
    ]
    for kls, penalties, after, adaptations in steps:
        got, stats = controller.penalise_batch(kls)
        assert got == pytest.approx(penalties, rel=1e-12)
        assert controller.kl_coeff == pytest.approx(after, rel=1e-12)
        assert (stats.adaptation_count, controller.adaptation_count) == (adaptations, adaptations)
    assert controller.samples_processed == 2 + 1 + 3 + 3 + 3 + 7
    # Down to the lower clamp: 0.8^20 = 0.0115 is still above 0.01, 0.8^21 = 0.0092 is not.
    for _ in range(20):
        controller.penalise_batch([0.0, 0.0, 0.0])
    assert controller.kl_coeff == pytest.approx(0.8 ** 20, rel=1e-12)
    controller.penalise_batch([0.0, 0.0, 0.0])
    assert controller.kl_coeff == 0.01 and controller.adaptation_count == 8 + 21
    # The seed's stats: over the last 100 KLs (82 so far), with the coefficient and counters.
    stats = controller.get_stats().to_dict()
    assert stats["kl/coeff"] == 0.01 and stats["kl/adaptation_count"] == 29
    assert stats["kl/max"] == 100.0 and stats["kl/min"] == 0.0


def test_seed_per_sample_order_by_hand():
    # penalise_sample records, adapts, then penalises with the coefficient after adapting (the seed's
    # get_penalty_from_logprobs): window 1, target 2, a KL of 10 moves 0.1 to 0.15 first.
    controller = KLController(ControllerConfig(window=1, kl_target=2.0))
    assert controller.penalise_sample(10.0) == pytest.approx(1.5, rel=1e-12)
    assert controller.penalise_sample(2.0) == pytest.approx(0.3, rel=1e-12)  # in the band: 0.15 stays
    assert controller.penalise_sample(0.0) == 0.0 and controller.kl_coeff == pytest.approx(0.12, rel=1e-12)
    # The seed's KL of one response: the mean of policy − ref, clamped at 0.
    assert controller.get_penalty_from_logprobs([-1.0, -2.0], [-2.0, -5.0]) == (pytest.approx(0.24), 2.0)
    assert controller.get_penalty_from_logprobs([-3.0], [-1.0])[1] == 0.0
