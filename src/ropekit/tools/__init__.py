"""The tools wing: what people run, built on the library and never imported by it.

verify (numerical proof of the mathematics and of the production backends), inspect (per-pair view of a
config's frequencies), bench (timing and memory harness) and demo (the length-extrapolation experiment).
The `ropekit` command (:mod:`ropekit.cli`) parses arguments and calls these.
"""
