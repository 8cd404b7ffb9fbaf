"""The registered layout families: every module of this package registers its layouts on import.

Adding a layout is adding one module here that builds a ``Layout`` and calls ``register``:
it is found and imported with the package, in name order.
"""

import importlib
import pkgutil

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
