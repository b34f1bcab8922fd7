"""Execution: the model and its weights loaded, a step's batch turned into tensors and run (eagerly, in
CUDA graphs, or overlapped), logits processed and tokens drawn."""
