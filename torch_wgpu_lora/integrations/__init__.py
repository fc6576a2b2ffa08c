"""Integrations: transformers' BitNet models, adapter files, gradient checks."""
