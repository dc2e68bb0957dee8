"""The end-to-end demo: synthetic data, the pipeline run through the CLI, and its HTML report."""
