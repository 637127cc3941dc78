"""``python -m rolling_forcing`` runs the ``rolling-forcing`` CLI."""

from rolling_forcing.entry import main

if __name__ == "__main__":
    main()
