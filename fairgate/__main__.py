"""``python -m fairgate`` runs the command line."""

from fairgate.cli import main

main()
