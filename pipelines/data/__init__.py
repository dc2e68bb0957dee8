"""Data for the tasks: stored regions to model tensors, text, answer tables, JSON rows, datasets."""
