from .entrypoints.cli import cli

cli()
