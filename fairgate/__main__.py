"""``python -m fairgate`` and the ``fairgate`` command: the command line (``fairgate.cli``).

The entry point imports the command line itself, so that a Ctrl-C while it loads (its libraries take a few
tenths of a second) ends with one line and exit code 130 (128 + SIGINT) instead of a traceback; once the
command line runs, its commands handle Ctrl-C themselves.

``fairgate serve`` reloads its keys on SIGHUP once it serves (``fairgate.gateway.reload``); a SIGHUP before
then - while it loads and starts, a second or so - is ignored with a line on stderr rather than killing it
(a config-management tool may signal it right after starting it).
"""

import signal
import sys


def _hangup_too_early(signum: int, frame: object) -> None:
    print("fairgate serve: SIGHUP while starting: ignored (send it again once it serves)", file=sys.stderr)


def main() -> None:
    """Run the command line; a Ctrl-C that reaches here exits 130 with one line."""
    if sys.argv[1:2] == ["serve"] and hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, _hangup_too_early)
    try:
        from fairgate.cli import main as run

        run()  # typer builds the commands before click's own Ctrl-C handling runs
    except KeyboardInterrupt:
        print("fairgate: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
