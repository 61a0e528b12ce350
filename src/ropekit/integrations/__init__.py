"""Integrations with other libraries. Each submodule imports its library lazily: ``ropekit.integrations.hf``
needs transformers only for the models it is given."""
