"""Offline subcommands of the `lens-callbacks` console script (one module each, with `main(argv) -> int`)."""
