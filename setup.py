"""Package map (everything else is in pyproject.toml): the source directories ``cli/`` and
``fixtures/`` stay at the top of the checkout and install inside the package as ``kvbridge.cli``
(the command line) and ``kvbridge/fixtures`` (the golden vectors ``kvbridge verify`` reads).

``kvbridge.backends.native._kernels`` (kvbridge/backends/native/_kernels.c, with xxHash's vendored header
``xxhash.h`` beside it) is an optional C extension: built with the machine's compiler for the baseline ISA
(its AVX-512 functions carry their own target attributes and are chosen at run time), and when there is no
compiler or the build fails, setuptools prints a warning and installs the package without it (kvbridge
then runs its numba kernels)."""

import sys

from setuptools import Extension, find_packages, setup

PACKAGE_DIR = {"kvbridge.cli": "cli", "kvbridge.fixtures": "fixtures"}

packages = find_packages(include=["kvbridge", "kvbridge.*"])
packages += ["kvbridge.cli", *(f"kvbridge.cli.{p}" for p in find_packages("cli")), "kvbridge.fixtures"]
# -ffp-contract=off: no fused multiply-adds, so every fp32 step rounds as the numba kernels' do.
flags = [] if sys.platform == "win32" else ["-O3", "-ffp-contract=off", "-fno-math-errno"]
kernels = Extension("kvbridge.backends.native._kernels", ["kvbridge/backends/native/_kernels.c"],
                    depends=["kvbridge/backends/native/xxhash.h"], extra_compile_args=flags, optional=True)
setup(packages=packages, package_dir=PACKAGE_DIR, ext_modules=[kernels])
