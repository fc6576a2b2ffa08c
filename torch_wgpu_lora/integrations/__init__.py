"""Integrations: transformers' BitNet models, adapter files, PEFT's model API and PEFT models, gradient checks."""
