"""`python -m decentrl ...`: the same CLI as the `decentrl` script (torchrun launches this)."""

from decentrl.cli.main import app

app()
