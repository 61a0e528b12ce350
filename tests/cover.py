"""The per-axis cover of a parametrized test: the fast tier's representative cases (tests/conftest.py's
``cover`` marker, tests/triton_interpreter.py's fast tier); the other cases run in ``make proofs``."""


def per_axis_cover(items: list) -> list:
    """Of one case function's parametrized items, a few that hold every value of every parameter (greedy,
    in collection order); an item with no parameters is kept."""
    values = {item: set() for item in items}
    for item in items:
        if hasattr(item, "callspec"):
            values[item] = {(name, repr(v)) for name, v in item.callspec.params.items()}
    wanted = set().union(*values.values())
    chosen = [item for item in items if not values[item]]
    while wanted:
        best = max(items, key=lambda item: len(wanted & values[item]))
        chosen.append(best)
        wanted -= values[best]
    return [item for item in items if item in chosen]  # collection order
