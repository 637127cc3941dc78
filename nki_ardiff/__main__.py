"""``python -m rolling_forcing`` runs the ``rolling-forcing`` CLI."""

from nki_ardiff.entry import main

if __name__ == "__main__":
    main()
