"""The cache tensors, their sizing and the block copies the scheduler asks for."""
