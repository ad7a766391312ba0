"""Attention backends behind one function: a torch reference over block tables."""
