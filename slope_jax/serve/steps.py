"""How a batch of prompts becomes engine steps (pure Python; no JAX, no numpy).

A compiled prefill step runs prompts of one length bucket, at most `per_step` of them (`parallel.in_flight` on a
mesh, 1 on one device). `group_steps` is the one place that grouping is decided: the launcher runs a batch's steps in
this order (`serve.compute`), the scheduler predicts the step shapes `(bucket, len(indices))` it will compile
(`serve.scheduler`), and the engine runs a batch the same way.

    >>> group_steps([5, 40, 7, 33, 6], bucket=lambda n: 32 if n <= 32 else 64, per_step=2)
    [(32, [0, 2]), (32, [4]), (64, [1, 3])]
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence, TypeVar

T = TypeVar("T", bound=Hashable)


def group_steps(lengths: Sequence[int], bucket: Callable[[int], T], per_step: int) -> list[tuple[T, list[int]]]:
    """The engine steps of a batch.

    Args:
      lengths: each prompt's token count, in the batch's order.
      bucket: token count -> the step's padded length (or any comparable key: prompts with equal keys share steps).
      per_step: most prompts per step (>= 1).
    Returns:
      [(bucket, [indices into `lengths`])], ordered by bucket, then by position in `lengths`; consecutive prompts of
      a bucket fill a step up to `per_step` before the next step of that bucket starts (so every step but the last of
      a bucket is full). Every index appears exactly once.
    Raises:
      ValueError if per_step < 1.
    """
    if int(per_step) < 1:
        raise ValueError(f"per_step={per_step}: must be >= 1")
    keys = [bucket(n if isinstance(n, tuple) else int(n)) for n in lengths]  # a tuple: (n, cached), a prefix hit
    # keys may mix a bucket (an int) and a prefix hit's (bucket, cached rows): order them as (bucket, rows)
    order = sorted(range(len(keys)), key=lambda i: (keys[i] if isinstance(keys[i], tuple) else (keys[i], 0), i))
    steps: list[tuple[T, list[int]]] = []
    for i in order:
        if steps and steps[-1][0] == keys[i] and len(steps[-1][1]) < per_step:
            steps[-1][1].append(i)
        else:
            steps.append((keys[i], [i]))
    return steps


def step_shapes(lengths: Sequence[int], bucket: Callable[[int], T], per_step: int) -> set[tuple[T, int]]:
    """The distinct compiled step shapes `(bucket, prompts in the step)` a batch of these lengths runs."""
    return {(t, len(idx)) for t, idx in group_steps(lengths, bucket, per_step)}
