"""The ``kvbridge`` command line (click + rich), a thin layer over the public API."""
