"""Datasets, training, evaluation, Ray jobs and the `xmodal` command line."""
