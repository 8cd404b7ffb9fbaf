"""``python -m kvbridge.cli``: the ``kvbridge`` command."""

from .main import main

main()
