"""The `verst` command. One module per concept (jobs.py: submit, status, cancel; local.py: up,
demo; export.py; watch.py: a job followed live); app.py holds the command table (``COMMANDS``)
and the error handling every command shares."""

from services.cli.app import COMMANDS, main, parser

__all__ = ["COMMANDS", "main", "parser"]
