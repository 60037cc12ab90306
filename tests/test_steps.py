"""`slope_jax.serve.steps.group_steps`: the one grouping of a batch into engine steps (bucket, then arrival order,
at most per_step prompts per step), against a brute-force reference of the rule, and its users agreeing with it."""

import random

import pytest

from slope_jax.serve.steps import group_steps, step_shapes


def bucket32(n: int) -> int:
    return 32 * -(-n // 32)


def _reference(lengths, bucket, per_step):
    """The launcher's former loop, verbatim in spirit: sort by (bucket, index), cut runs of one bucket into chunks."""
    order = sorted(range(len(lengths)), key=lambda i: (bucket(lengths[i]), i))
    out, start = [], 0
    while start < len(order):
        t = bucket(lengths[order[start]])
        chunk = [order[start]]
        while (len(chunk) < per_step and start + len(chunk) < len(order)
               and bucket(lengths[order[start + len(chunk)]]) == t):
            chunk.append(order[start + len(chunk)])
        out.append((t, chunk))
        start += len(chunk)
    return out


def test_docstring_example():
    assert group_steps([5, 40, 7, 33, 6], bucket=lambda n: 32 if n <= 32 else 64, per_step=2) == \
        [(32, [0, 2]), (32, [4]), (64, [1, 3])]


def test_empty_and_single():
    assert group_steps([], bucket32, 4) == []
    assert group_steps([70], bucket32, 4) == [(96, [0])]


def test_one_per_step_keeps_bucket_then_arrival_order():
    assert group_steps([100, 3, 99, 4], bucket32, 1) == [(32, [1]), (32, [3]), (128, [0]), (128, [2])]


def test_full_steps_before_the_rest():
    steps = group_steps([1] * 7, bucket32, 3)
    assert steps == [(32, [0, 1, 2]), (32, [3, 4, 5]), (32, [6])]
    assert step_shapes([1] * 7, bucket32, 3) == {(32, 3), (32, 1)}


@pytest.mark.parametrize("seed", range(20))
def test_matches_reference_and_partitions(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(0, 30))]
    per_step = rng.randint(1, 5)
    steps = group_steps(lengths, bucket32, per_step)
    assert steps == _reference(lengths, bucket32, per_step)
    flat = [i for _, idx in steps for i in idx]
    assert sorted(flat) == list(range(len(lengths)))  # every prompt exactly once
    for t, idx in steps:
        assert 1 <= len(idx) <= per_step and all(bucket32(lengths[i]) == t for i in idx)
    # the scheduler's shape rule: per bucket c prompts -> (t, per_step) if c >= per_step, and (t, c % per_step)
    counts = {}
    for n in lengths:
        counts[bucket32(n)] = counts.get(bucket32(n), 0) + 1
    expect = {(t, per_step) for t, c in counts.items() if c >= per_step} | \
        {(t, c % per_step) for t, c in counts.items() if c % per_step}
    assert step_shapes(lengths, bucket32, per_step) == expect


def test_per_step_must_be_positive():
    with pytest.raises(ValueError, match="per_step=0"):
        group_steps([1], bucket32, 0)


def test_scheduler_and_predictor_use_the_same_steps():
    from slope_jax.serve.scheduler import Pending, Scheduler, batch_predictor

    calls = []
    predict = batch_predictor(lambda t, m: calls.append((t, m)) or float(t * m), bucket32, per_step=2)
    assert predict([5, 40, 7, 33, 6]) == 32 * 2 + 32 * 1 + 64 * 2
    assert sorted(set(calls)) == [(32, 1), (32, 2), (64, 2)]
    s = Scheduler(predict, batch_size=8, batch_wait_ms=0, bucket=bucket32, per_step=2)
    batch = [Pending(None, str(i), n, 0.0) for i, n in enumerate([5, 40, 7, 33, 6])]
    assert s._shapes(batch) == step_shapes([5, 40, 7, 33, 6], bucket32, 2) == {(32, 2), (32, 1), (64, 2)}
