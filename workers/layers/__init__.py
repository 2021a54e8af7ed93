"""Tensor-parallel building blocks of the models: linear, embedding, norm, rotary."""
