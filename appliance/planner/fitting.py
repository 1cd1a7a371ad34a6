"""Fitting a step cost model (planner/profile.py's StepCost) to timed steps.

Pure Python: a few dozen samples and at most eight features, so the normal equations are
solved by hand. Each sample is weighted by its own time (relative error), so the
millisecond decode steps count as much as the second-long prompts; coefficients are kept
non-negative by dropping a feature whose fitted cost comes out below zero.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

from appliance.planner.profile import StepCost

FEATURES = (
    "tokens",
    "seqs",
    "attended",
    "context",
    "row_tokens",
    "gemm_tokens",
    "gemm",
    "draft_rows",
)
FIELDS = MappingProxyType(
    {
        "tokens": "per_token_s",
        "seqs": "per_seq_s",
        "attended": "per_attended_s",
        "context": "per_context_s",
        # The two kernel regimes (StepCost.gemm_rows): a step's tokens counted in one of
        # the first two, and the second regime's fixed cost (1 for its steps, else 0).
        "row_tokens": "per_token_s",
        "gemm_tokens": "per_gemm_token_s",
        "gemm": "gemm_base_s",
        # A speculative verify step's draft rows, beside its decode rows (step_timing).
        "draft_rows": "per_draft_s",
    }
)
REGIME_FEATURES = ("row_tokens", "gemm_tokens", "gemm")

Sample = Mapping[str, float | int | str]


def in_regimes(features: Sequence[str]) -> tuple[str, ...]:
    """`features` with tokens split by kernel regime (REGIME_FEATURES in its place)."""
    if "tokens" not in features:
        return tuple(features)
    at = list(features).index("tokens")
    return (*features[:at], *REGIME_FEATURES, *features[at + 1 :])


def regime_sample(sample: Sample, gemm_rows: int) -> dict[str, float | int | str]:
    """A sample with its tokens split by regime: it ran its products as GEMMs when its
    prompt tokens ("prompt_tokens", else all its tokens) reached `gemm_rows`."""
    tokens = float(sample["tokens"])
    gemm = float(sample.get("prompt_tokens", tokens)) >= gemm_rows
    return {
        **sample,
        "row_tokens": 0.0 if gemm else tokens,
        "gemm_tokens": tokens if gemm else 0.0,
        "gemm": 1.0 if gemm else 0.0,
    }


def both_regimes(points: Iterable[tuple[bool, float]], min_steps: int = 1) -> bool:
    """Whether steps (each: ran as a GEMM, its tokens) show both sides of the kernel
    switch well enough to fit a line to each: on each side at least `min_steps` steps of
    two or more token counts (a line through one point is any line)."""
    sides: dict[bool, list[float]] = {False: [], True: []}
    for gemm, tokens in points:
        sides[gemm].append(tokens)
    return all(len(side) >= min_steps and len(set(side)) >= 2 for side in sides.values())


def fit_step_cost(
    samples: Sequence[Sample], features: Sequence[str], gemm_rows: int | None = None
) -> StepCost:
    """The StepCost (base plus the named features) closest to the samples' seconds in
    relative error, every coefficient >= 0. With `gemm_rows` the samples carry the regime
    features (regime_sample) and the cost its two lines."""
    unknown = set(features) - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown step features {sorted(unknown)}; use {FEATURES}")
    if (gemm_rows is not None) != bool(set(REGIME_FEATURES) & set(features)):
        raise ValueError("the regime features go with a gemm_rows, and it with them")
    if "tokens" in features and "row_tokens" in features:
        raise ValueError("tokens and row_tokens are the same coefficient: fit one of them")
    if not samples:
        raise ValueError("no timed steps to fit")
    kept = list(features)
    while True:
        coefficients = _least_squares(samples, kept)
        negative = [name for name, value in zip(kept, coefficients[1:], strict=True) if value < 0]
        if coefficients[0] >= 0 and not negative:
            break
        if not negative:  # only the base came out negative: pin it at zero
            return _without_base(samples, kept, gemm_rows)
        kept.remove(min(negative, key=lambda name: coefficients[1 + kept.index(name)]))
    values = dict(zip(kept, coefficients[1:], strict=True))
    return StepCost(
        base_s=coefficients[0],
        gemm_rows=gemm_rows,
        **{FIELDS[name]: values[name] for name in kept},
    )


def _without_base(samples: Sequence[Sample], kept: list[str], gemm_rows: int | None) -> StepCost:
    rows = [[float(s[name]) for name in kept] for s in samples]
    solution = _solve_weighted(rows, [float(s["seconds"]) for s in samples])
    values = {name: max(0.0, v) for name, v in zip(kept, solution, strict=True)}
    return StepCost(
        base_s=0.0, gemm_rows=gemm_rows, **{FIELDS[name]: values[name] for name in kept}
    )


def _least_squares(samples: Sequence[Sample], features: list[str]) -> list[float]:
    rows = [[1.0, *(float(s[name]) for name in features)] for s in samples]
    return _solve_weighted(rows, [float(s["seconds"]) for s in samples])


def _solve_weighted(rows: list[list[float]], seconds: list[float]) -> list[float]:
    """argmin_x sum_i ((rows_i . x - seconds_i) / seconds_i)^2, by the normal equations."""
    if any(t <= 0 for t in seconds):
        raise ValueError("a timed step took no time")
    scaled = [[v / t for v in row] for row, t in zip(rows, seconds, strict=True)]
    width = len(rows[0])
    # Columns are scaled to unit size first: tokens and attended pairs differ by 1e6.
    norms = [max(abs(row[j]) for row in scaled) or 1.0 for j in range(width)]
    a = [[row[j] / norms[j] for j in range(width)] for row in scaled]
    gram = [[sum(r[i] * r[j] for r in a) for j in range(width)] for i in range(width)]
    rhs = [sum(r[i] for r in a) for i in range(width)]  # targets are all 1 after scaling
    solution = _gauss(gram, rhs)
    return [x / n for x, n in zip(solution, norms, strict=True)]


def _gauss(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Solve matrix @ x = rhs (Gaussian elimination, partial pivoting); a feature that no
    sample varies (a zero pivot) gets 0."""
    n = len(rhs)
    m = [[*row, b] for row, b in zip(matrix, rhs, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-12:
            continue
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        if abs(m[r][r]) < 1e-12:
            continue
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
