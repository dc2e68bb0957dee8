"""Everything above the networks: engine/ (training loop), data/, tasks/ (TASKS), jobs/ (Ray), apps/, the CLI."""
