"""`python -m sprig.runtime serve --model PATH ...` (the same as the `sprig` command)."""

if __name__ == "__main__":  # the server's spawned children re-import this module: keep it empty
    from sprig.runtime.cli import entry

    entry()
