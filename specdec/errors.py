"""User-facing errors: one line that names the file, tensor or flag at fault."""


class SpecdecError(Exception):
    """Bad input from the user (checkpoint, prompt, flag). The CLI prints it as one line and exits 1."""
