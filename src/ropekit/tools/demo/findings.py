"""The demo report's sentences, each generated from the numbers by a stated rule (one test per rule in
tests/tools/demo/test_findings.py).

Retrieval is read by the key's distance from the query, not by window length: a model trained on windows of
L has seen relative distances 0 .. L - 1 only, and a long window also holds keys that are near the query.
Cells (method, length, depth) are pooled only where their 95% Wilson intervals overlap (:func:`agree`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "KEEPS",
    "RETRIEVES",
    "agree",
    "before_L",
    "beyond_sentence",
    "literature_sentence",
    "opening",
    "perplexity_sentence",
    "reach",
    "split_by_distance",
    "within_sentence",
]

# A cell "retrieves" when more than half of its keys come back exactly; a method "keeps perplexity" when its
# perplexity at the longest length is within 10% of its own at L.
RETRIEVES = 0.5
KEEPS = 1.10
# Before L, a loss difference smaller than this (nats, mean over the first L bytes) counts as none.
SAME_LOSS = 0.01


def percent(x: float) -> str:
    return f"{100 * x:.0f}%"


def join(items: Sequence[str]) -> str:
    items = list(items)
    if not items:
        return ""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def span(values: Sequence[float]) -> str:
    """ "34%" for one value (or equal ones), "12-34%" for several."""
    low, high = percent(min(values)), percent(max(values))
    return low if low == high else f"{low[:-1]}-{high}"


def verb(names: Sequence[str], plural: str, singular: str) -> str:
    """The verb form that agrees with a list of method names."""
    return singular if len(names) == 1 else plural


def in_L(distance: float, train_length: int) -> str:
    return f"{distance / train_length:.1f}L"


def agree(rows: Sequence[dict]) -> bool:
    """Whether cells may be pooled: their 95% Wilson intervals share a point (the largest low end is at most
    the smallest high end)."""
    return bool(rows) and max(r["ci_low"] for r in rows) <= min(r["ci_high"] for r in rows)


def methods_of(rows: Sequence[dict]) -> list[str]:
    return list(dict.fromkeys(r["method"] for r in rows))


def split_by_distance(retrieval: Sequence[dict], method: str, train_length: int) -> tuple[list, list]:
    """``method``'s cells with the key within L of the query (distance < L, seen in training) and the cells
    with it L or more back, each sorted by distance."""
    rows = sorted((r for r in retrieval if r["method"] == method), key=lambda r: (r["distance"], r["length"]))
    return [r for r in rows if r["distance"] < train_length], [
        r for r in rows if r["distance"] >= train_length
    ]


def reach(beyond: Sequence[dict]) -> tuple[dict | None, dict | None]:
    """(the farthest cell up to which every cell retrieves, the nearest cell that does not); None for either
    when there is none. ``beyond`` sorted by distance."""
    last = None
    for row in beyond:
        if row["accuracy"] <= RETRIEVES:
            return last, row
        last = row
    return last, None


def within_sentence(retrieval: Sequence[dict], train_length: int) -> str:
    """Who retrieves keys fewer than L bytes back: every such cell above half, none, or some."""
    L = train_length
    groups: dict[str, list[str]] = {"all": [], "none": [], "some": []}
    values: dict[str, list[float]] = {"all": [], "none": [], "some": []}
    for m in methods_of(retrieval):
        within, _ = split_by_distance(retrieval, m, L)
        if not within:
            continue
        acc = [r["accuracy"] for r in within]
        kind = "all" if min(acc) > RETRIEVES else "none" if max(acc) <= RETRIEVES else "some"
        groups[kind].append(m)
        values[kind] += acc
    parts = []
    if groups["all"]:
        names = groups["all"]
        parts.append(
            f"{join(names)} {verb(names, 'retrieve', 'retrieves')} them ({span(values['all'])} per cell)"
        )
    if groups["some"]:
        parts.append(f"{join(groups['some'])} only in some cells ({span(values['some'])})")
    if groups["none"]:
        names = groups["none"]
        parts.append(f"{join(names)} {verb(names, 'do', 'does')} not ({span(values['none'])})")
    if not parts:
        return f"No cell puts a key fewer than L = {L} bytes before the query."
    return (
        f"Keys fewer than L = {L} bytes before the query (distances seen in training): "
        + "; ".join(parts)
        + "."
    )


def beyond_sentence(retrieval: Sequence[dict], train_length: int) -> str:
    """How far back each method still retrieves, for the methods that retrieve within L."""
    L = train_length
    every, never, partial, skipped = [], [], [], []
    every_values: list[float] = []
    never_values: list[float] = []
    farthest = 0
    for m in methods_of(retrieval):
        within, beyond = split_by_distance(retrieval, m, L)
        if not beyond:
            continue
        if within and min(r["accuracy"] for r in within) <= RETRIEVES:
            skipped.append(m)
            continue
        last, first_fail = reach(beyond)
        acc = [r["accuracy"] for r in beyond]
        if first_fail is None:
            every.append(m)
            every_values += acc
            farthest = max(farthest, beyond[-1]["distance"])
        elif max(acc) <= RETRIEVES:
            never.append(m)
            never_values += acc
        else:
            after = [r["accuracy"] for r in beyond if r["distance"] >= first_fail["distance"]]
            head = (
                f"{m} up to {in_L(last['distance'], L)} back ({percent(last['accuracy'])} there)"
                if last is not None
                else f"{m} not at {in_L(first_fail['distance'], L)} back"
            )
            partial.append(f"{head}, {span(after)} from {in_L(first_fail['distance'], L)} on")
    parts = []
    if every:
        parts.append(
            f"{join(every)} {verb(every, 'retrieve', 'retrieves')} at every distance tested, "
            f"up to {in_L(farthest, L)} back "
            f"({span(every_values)} per cell)"
        )
    parts += partial
    if never:
        parts.append(f"{join(never)} at no distance of L or more ({span(never_values)})")
    if not parts:
        return ""
    text = "Keys L or more bytes back (distances never seen in training): " + "; ".join(parts) + "."
    if skipped:
        miss, are = verb(skipped, "miss", "misses"), verb(skipped, "are", "is")
        text += f" ({join(skipped)}, which {miss} keys even within L, {are} left out.)"
    return text


def perplexity_sentence(results: Sequence[dict], train_length: int) -> str:
    """Which methods keep their perplexity at the longest length within KEEPS of their own at L; the others'
    growth, least and most, only when there are others."""
    L = train_length
    lengths = sorted({r["length"] for r in results})
    longest = lengths[-1]
    value = {(r["method"], r["length"]): r["perplexity"] for r in results}
    kept, grown = [], []
    for m in methods_of(results):
        a, b = value.get((m, L)), value.get((m, longest))
        if a is None or b is None or longest == L:
            continue
        growth = b / a if a > 0 and math.isfinite(b) else math.inf
        (kept if growth <= KEEPS else grown).append((m, growth))
    if not kept and not grown:
        return ""
    at = f"{longest / L:g}L"
    within = f"within {100 * (KEEPS - 1):.0f}% of the same model's at L"

    def growth(item: tuple[str, float]) -> str:
        return f"{item[0]} (x{item[1]:.2f})" if math.isfinite(item[1]) else f"{item[0]} (to infinity)"

    if not grown:
        return f"Perplexity at {at} stays {within} for every method."
    least, most = min(grown, key=lambda x: x[1]), max(grown, key=lambda x: x[1])
    extremes = f"least for {growth(least)}" + (f" and most for {growth(most)}" if most != least else "")
    if not kept:
        more = f"by more than {100 * (KEEPS - 1):.0f}% over the same model's at L"
        return f"Perplexity at {at} grows {more} for every method: {extremes}."
    kept_names = join([m for m, _ in kept])
    if len(grown) == 1:
        return f"Perplexity at {at} stays {within} for {kept_names}; the other, {growth(least)}, grows more."
    return f"Perplexity at {at} stays {within} for {kept_names}; among the others it grows {extremes}."


def literature_sentence(retrieval: Sequence[dict], train_length: int) -> str:
    """The passkey claims of the PI and YaRN papers, checked by distance: plain RoPE stops retrieving once the
    key is well past L (it fails at some distance of at most 2L), and a short PI or YaRN fine-tune retrieves
    farther back than plain RoPE. Only meaningful when rope retrieves within L."""
    L = train_length
    within, beyond = split_by_distance(retrieval, "rope", L)
    if not within or min(r["accuracy"] for r in within) <= RETRIEVES or not beyond:
        return (
            "The comparison with the passkey results of the PI and YaRN papers needs a rope model that "
            "retrieves within L and keys placed L or more back, which this run does not have."
        )
    last, first_fail = reach(beyond)
    checks = []
    if first_fail is None:
        rope_says = f"retrieves at every distance tested, to {in_L(beyond[-1]['distance'], L)}"
        checks.append((f"plain RoPE fails for keys well past L (it {rope_says})", False))
        rope_reach = beyond[-1]["distance"]
    else:
        found = f"{percent(last['accuracy'])} at {in_L(last['distance'], L)}, " if last is not None else ""
        said = f"{found}{percent(first_fail['accuracy'])} at {in_L(first_fail['distance'], L)} back"
        checks.append((f"plain RoPE fails for keys well past L ({said})", first_fail["distance"] <= 2 * L))
        rope_reach = last["distance"] if last is not None else 0
    for m, name in (("rope+linear+finetune", "PI"), ("rope+yarn+finetune", "YaRN")):
        tuned_within, tuned_beyond = split_by_distance(retrieval, m, L)
        if not tuned_beyond:
            continue
        tuned_last, _ = reach(tuned_beyond)
        tuned_reach = tuned_last["distance"] if tuned_last is not None else 0
        ok = (
            tuned_reach > rope_reach
            and bool(tuned_within)
            and min(r["accuracy"] for r in tuned_within) > RETRIEVES
        )
        where = f"to {in_L(tuned_reach, L)}" if tuned_reach else "at no distance of L or more"
        checks.append(
            (f"{name} after a short fine-tune retrieves farther back than plain RoPE ({where})", ok)
        )
    agree_ = [c for c, ok in checks if ok]
    disagree = [c for c, ok in checks if not ok]
    parts = []
    if agree_:
        parts.append("reproduced: " + "; ".join(agree_))
    if disagree:
        parts.append("not reproduced: " + "; ".join(disagree))
    return "Against the passkey results of the PI and YaRN papers: " + "; ".join(parts) + "."


def opening(results: Sequence[dict], retrieval: Sequence[dict], train_length: int) -> str:
    """The report's first paragraphs: retrieval within and beyond L; perplexity; the literature."""
    paragraphs = []
    if retrieval:
        paragraphs.append(
            " ".join(
                s
                for s in (within_sentence(retrieval, train_length), beyond_sentence(retrieval, train_length))
                if s
            )
        )
    paragraphs.append(perplexity_sentence(results, train_length))
    if retrieval:
        paragraphs.append(literature_sentence(retrieval, train_length))
    return "\n\n".join(p for p in paragraphs if p)


def before_L(
    extra_loss: dict[str, list[float]], train_length: int, factors: dict[str, tuple[str, str]]
) -> list[str]:
    """What the first L positions of the loss-by-position comparison hold, per method.

    Args:
        extra_loss: per method, each byte's loss in the longest windows minus its loss within windows of L.
        factors: per method, how its rotation is set in the longest windows and in windows of L (for example
            ("factor 8", "factor 1")); methods absent use the same rotation in both.

    Returns:
        sentences: the methods whose two windows rotate alike (so the first L bytes see the same context and
        positions, and differ by float noise only), and for each other one, what differs and what it costs.
    """
    L = train_length
    same, changed = [], []
    for m, losses in extra_loss.items():
        head = float(np.mean(losses[:L]))
        if m in factors and factors[m][0] != factors[m][1]:
            changed.append(f"{m} ({factors[m][0]} against {factors[m][1]}: {head:+.2f} nats)")
        elif abs(head) < SAME_LOSS:
            same.append(m)
        else:
            changed.append(f"{m} ({head:+.2f} nats, though both windows rotate alike)")
    lines = []
    if same:
        lines.append(
            f"Before L, {join(same)} see the same bytes at the same positions encoded the same way in both "
            f"windows, so their curves start at 0 (mean over the first L bytes below {SAME_LOSS} nats)."
        )
    if changed:
        lines.append(
            "The others rotate the long window differently from the window of L, so before L their curve is "
            "the cost of that change alone, not of extra context: " + join(changed) + "."
        )
    return lines
