"""The training engine: the loop and its Task protocol, launch, checkpoints, run log, typed config IO."""
