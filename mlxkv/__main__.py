from .entrypoints.cli import app

app(prog_name="mlxkv")
