"""tests/engines/ runs in the engines environment (``make proofs``): a file whose engine is not installed is
not collected, so the main environment's ``make test`` never imports an engine."""

import importlib.util

# test file -> the engine it imports at module level
ENGINES = {"test_torchtitan.py": "torchtitan"}

collect_ignore = [name for name, engine in ENGINES.items() if importlib.util.find_spec(engine) is None]
