"""The typer command-line interface: thin entry points, heavy imports inside commands."""
