"""tests/engines runs only in .venv-engines (``make engines-venv``), where vLLM, SGLang and torchtitan are
installed: if they cannot be imported here, that is a broken environment, and the run fails (never skips).

The engines read their platform at import: vLLM is told it runs on the CPU before anything imports it.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

try:
    import sglang.srt.layers.rotary_embedding
    import sglang.srt.plugins  # noqa: F401
    import torchtitan.models.common.rope  # noqa: F401
    import vllm.config
    import vllm.model_executor.layers.rotary_embedding
    import vllm.plugins
except ImportError as err:  # pragma: no cover - a broken engines environment
    raise RuntimeError(
        f"tests/engines needs the engines environment (make engines-venv, then run it with "
        f".venv-engines/bin/python -m pytest tests/engines): {err}"
    ) from err


@pytest.fixture(scope="module")
def vllm_plugin_loaded():
    """vLLM's own plugin loading, as in a deployment (every entry point of vllm.general_plugins;
    VLLM_PLUGINS unset), then vLLM's default config current while the module's tests build vLLM modules."""
    os.environ.pop("VLLM_PLUGINS", None)
    vllm.plugins.load_general_plugins()
    with vllm.config.set_current_vllm_config(vllm.config.VllmConfig()):
        yield


@pytest.fixture
def vllm_numerics(monkeypatch, request):
    """The test module's ``plugin`` registered with ROPEKIT_NUMERICS=vllm (the engine's own forward_native
    bits), then registered again without it ("exact")."""
    register = request.module.plugin.register
    monkeypatch.setenv("ROPEKIT_NUMERICS", "vllm")
    register()
    yield
    monkeypatch.delenv("ROPEKIT_NUMERICS")
    register()
