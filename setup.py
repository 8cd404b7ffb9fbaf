"""Package map (everything else is in pyproject.toml): the source directories ``cli/`` and
``fixtures/`` stay at the top of the checkout and install inside the package as ``kvbridge.cli``
(the command line) and ``kvbridge/fixtures`` (the golden vectors ``kvbridge verify`` reads)."""

from setuptools import find_packages, setup

PACKAGE_DIR = {"kvbridge.cli": "cli", "kvbridge.fixtures": "fixtures"}

packages = find_packages(include=["kvbridge", "kvbridge.*"])
packages += ["kvbridge.cli", *(f"kvbridge.cli.{p}" for p in find_packages("cli")), "kvbridge.fixtures"]
setup(packages=packages, package_dir=PACKAGE_DIR)
