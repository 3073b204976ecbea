"""
Whether a difference over seeds is inside the seed noise: Welch's t-test (its p-value computed here, with no scipy),
Fisher's exact test on collapse counts, and how the reports print a mean ± std over seeds.
"""

import math

import numpy as np


# Two-sided Welch t-test level under which a difference between two algorithms counts as significant
SIGNIFICANCE = 0.05


def fmt(values: list[float], digits: int = 1, percent: bool = False) -> str:
    if not values or any(v is None or (isinstance(v, float) and math.isnan(v)) for v in values):
        return "n/a"
    scale = 100.0 if percent else 1.0
    mean, std = scale * float(np.mean(values)), scale * float(np.std(values))
    suffix = "%" if percent else ""
    if abs(mean) < 0.1 and not percent and mean != 0:
        return f"{mean:.3g} ± {std:.2g}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}{suffix}"


# ----------------------------------------------------------------------------------------------------------------------
# Significance


def regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    """``I_x(a, b)``, by its continued fraction (modified Lentz), on the side of ``x`` where it converges fast."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - regularized_incomplete_beta(b, a, 1.0 - x)
    tiny = 1e-300
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < 1e-13:
            break
    return math.exp(log_front) * fraction / a


def welch_p_value(a: list[float], b: list[float]) -> float:
    """
    Two-sided p-value of Welch's t-test of equal means (unequal variances); ``nan`` with fewer than 2 values on a
    side. A difference with p >= ``SIGNIFICANCE`` is inside the seed noise: a tie.
    """
    if len(a) < 2 or len(b) < 2:
        return float("nan")
    var_a, var_b = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    difference = float(np.mean(a) - np.mean(b))
    if var_a + var_b == 0:
        return 1.0 if difference == 0 else 0.0
    t = difference / math.sqrt(var_a + var_b)
    dof = (var_a + var_b) ** 2 / (var_a**2 / (len(a) - 1) + var_b**2 / (len(b) - 1))
    return t_two_sided_p(t, dof)


def t_two_sided_p(t: float, dof: float) -> float:
    """``P(|T| >= |t|)`` for Student's t with ``dof`` degrees of freedom."""
    return regularized_incomplete_beta(dof / 2.0, 0.5, dof / (dof + t * t))


def p_text(p: float) -> str:
    """A p-value as the report prints it: two decimals, three below 0.01, and ``p<0.001`` below that."""
    if math.isnan(p):
        return "p n/a"
    if p < 0.001:
        return "p<0.001"
    return f"p={p:.3f}" if p < 0.01 else f"p={p:.2f}"


def verdict(ours: list[float], theirs: list[float], higher_is_better: bool = True) -> tuple[str, str]:
    """
    :return: ``("+12.3 (p=0.04)", "better" | "worse" | "tie")``: the difference of the means (ours - theirs), its
        Welch p-value, and whether it is significant and in whose favour
    """
    difference = float(np.mean(ours) - np.mean(theirs))
    p = welch_p_value(ours, theirs)
    digits = 4 if max(abs(np.mean(ours)), abs(np.mean(theirs))) < 1 else 1
    text = f"{difference:+.{digits}f} ({p_text(p)})"
    if math.isnan(p) or p >= SIGNIFICANCE:
        return text, "tie"
    return text, "better" if (difference > 0) == higher_is_better else "worse"


def fisher_exact_p(a: int, n_a: int, b: int, n_b: int) -> float:
    """
    Two-sided p-value of Fisher's exact test that ``a`` of ``n_a`` and ``b`` of ``n_b`` come from one rate: the
    probability, under the hypergeometric law with the margins fixed, of the tables no more likely than the observed.
    """
    total, events = n_a + n_b, a + b

    def probability(k: int) -> float:
        return math.comb(n_a, k) * math.comb(n_b, events - k) / math.comb(total, events)

    observed = probability(a)
    low, high = max(0, events - n_b), min(n_a, events)
    return min(1.0, sum(p for k in range(low, high + 1) if (p := probability(k)) <= observed * (1 + 1e-9)))


def within_one_std(ours: list[float], theirs: list[float]) -> bool:
    """Whether the mean of ``ours`` is at least the mean of ``theirs`` minus one (population) std of ``theirs``."""
    return bool(np.mean(ours) >= np.mean(theirs) - np.std(theirs))
