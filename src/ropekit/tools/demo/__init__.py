"""`ropekit demo`: small byte-level transformers trained on the stdlib, showing how RoPE extrapolates.

Modules: data (corpus), model (the decoder), train (loop, DDP, perplexity), report (files and plots), run (the
whole job).
"""

from ropekit.tools.demo.run import QUICK, DemoSettings, run_demo

__all__ = ["QUICK", "DemoSettings", "run_demo"]
