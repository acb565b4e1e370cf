"""Errors meant for people: one line saying what was wrong and how to fix it."""


class BrigadeError(Exception):
    """A mistake in what the user asked for. The CLI prints it as one line, exit 2."""

    exit_code = 2


class RunError(BrigadeError):
    """The run itself failed (a worker died, a peer vanished). Exit 1."""

    exit_code = 1
