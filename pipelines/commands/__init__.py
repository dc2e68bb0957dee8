"""One module per `xmodal` subcommand, each with `add_arguments(parser)` and `run(args) -> int`."""
