"""The one map from a context-extension request (method, factor, original length) to a scaling dict.

``extend_context`` (Hugging Face models), ``ropekit inspect --method`` and the demo's inference-time scaling
all ask the same question: "extend a model trained on ``original`` tokens by ``factor`` with ``method``".
This module answers it once, so the three can never disagree on a default.
"""

from __future__ import annotations

from typing import Any

from ropekit.schedules.registry import get_schedule
from ropekit.validation import check_int, check_positive

__all__ = ["EXTEND_METHODS", "extension_scaling", "ntk_base"]

# The methods a model can be switched to after training, in the order docs list them.
EXTEND_METHODS = ("linear", "ntk", "dynamic", "yarn", "llama3", "longrope")


def ntk_base(base: float, factor: float, rotary_dim: int) -> float:
    """Static NTK-aware scaling (bloc97, 2023) as a new base: base * factor^(d / (d - 2)).

    The lowest frequency is then divided by exactly ``factor`` while the highest stays put.
    """
    return base * factor ** (rotary_dim / (rotary_dim - 2))


def extension_scaling(
    method: str, factor: float, original_max_position_embeddings: int, **params: Any
) -> tuple[dict[str, Any], int]:
    """The scaling dict and max_position_embeddings for extending a model ``factor`` times.

    Always computed from the model's *original* training length, so applying it twice equals applying it
    once. What each method gets:

    * ``linear``: factor (position interpolation, Chen et al. 2023).
    * ``ntk``: factor (ropekit's "ntk" schedule: the base becomes :func:`ntk_base`).
    * ``dynamic``: factor; max_position_embeddings stays the original length, since dynamic NTK grows the
      base only once a sequence passes it.
    * ``yarn``: factor and original_max_position_embeddings, plus any of beta_fast, beta_slow, mscale,
      mscale_all_dim, attention_factor, truncate.
    * ``llama3``: factor, original_max_position_embeddings, low_freq_factor (default 1), high_freq_factor
      (default 4).
    * ``longrope``: short_factor and long_factor (required in params), original_max_position_embeddings; the
      factor is carried by max_position_embeddings (HF derives it from the ratio), so it is not in the dict.

    Every method but dynamic gets max_position_embeddings = int(original * factor).

    Raises:
        ValueError: for an unknown method, a factor that is not a finite number >= 1, or a bad original
            length. Unknown or missing method keys are reported when the dict is turned into a RopeConfig.
    """
    if method not in EXTEND_METHODS:
        raise ValueError(f"method: expected one of {EXTEND_METHODS}, got {method!r}")
    factor = check_positive("factor", factor)
    if factor < 1:
        raise ValueError(f"factor: expected a number >= 1 (an extension, not a shrink), got {factor!r}")
    original = check_int(
        "original_max_position_embeddings",
        original_max_position_embeddings,
        minimum=1,
        expected="a positive integer (the pre-training context length)",
    )
    scaling: dict[str, Any] = {"rope_type": get_schedule(method).name, "factor": factor}
    if method in ("yarn", "llama3", "longrope"):
        scaling["original_max_position_embeddings"] = original
    if method == "llama3":
        scaling.update(low_freq_factor=1.0, high_freq_factor=4.0)
    if method == "longrope":
        del scaling["factor"]
    scaling.update(params)
    max_positions = original if method == "dynamic" else int(original * factor)
    return scaling, max_positions
