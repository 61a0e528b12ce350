"""`python -m ropekit` is the `ropekit` command."""

from ropekit.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
