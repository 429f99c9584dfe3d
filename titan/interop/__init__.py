"""Checkpoint interop: model-only DCP folders, Hugging Face folders, Meta releases, generation."""
