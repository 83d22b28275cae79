"""Layers shared by every model family; a model file only wires them together."""
