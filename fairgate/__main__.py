"""``python -m fairgate`` and the ``fairgate`` command: the command line (``fairgate.cli``).

The entry point imports the command line itself, so that a Ctrl-C while it loads (its libraries take a few
tenths of a second) ends with one line and exit code 130 (128 + SIGINT) instead of a traceback; once the
command line runs, its commands handle Ctrl-C themselves.
"""

import sys


def main() -> None:
    """Run the command line; a Ctrl-C that reaches here exits 130 with one line."""
    try:
        from fairgate.cli import main as run

        run()  # typer builds the commands before click's own Ctrl-C handling runs
    except KeyboardInterrupt:
        print("fairgate: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
