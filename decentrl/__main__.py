"""`python -m decentrl ...`: the same CLI as the `decentrl` script (torchrun launches this).
Every role runs through here (decentrl/cli/launch.py starts them so) and ends without the
interpreter's teardown of modules (decentrl/exit.py)."""

from decentrl.cli.main import app
from decentrl.exit import exit_now

try:
    app()
except SystemExit as done:  # typer's way out, whatever the command returned
    exit_now(done.code)
exit_now(0)
