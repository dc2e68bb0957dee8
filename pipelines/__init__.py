"""Everything above the networks: engine/ (the training loop), data/, tasks/ (the TASKS table), jobs/ (Ray),
apps/ and the `xmodal` command line."""
