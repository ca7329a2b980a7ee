"""What more than one test file uses: scenarios, calls and assertions. Test files import from here (``helpers`` is on
pytest's path: ``pythonpath`` in pyproject.toml), never from another test file."""
