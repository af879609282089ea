"""Tensors and plain arguments: the engine (log-probs, the weighted loss, the optimizer and its schedule), packing,
model families, precision, oneDNN, CPU attention, statistics. Nothing here reads a Config.
"""
