"""`python -m kvplan ...`: see kvplan.cli."""

from kvplan.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
