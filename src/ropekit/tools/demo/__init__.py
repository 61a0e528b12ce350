"""`ropekit demo`: small byte-level transformers trained on the stdlib, showing how RoPE extrapolates.

Modules: data (corpus and passkeys), model (the decoder), train (loop, DDP, perplexity), findings (the
report's sentences, from the numbers), report (results.json, tables, report.md), plots, run (the whole job).
"""

from ropekit.tools.demo.run import QUICK, DemoSettings, rewrite_report, run_demo

__all__ = ["QUICK", "DemoSettings", "rewrite_report", "run_demo"]
