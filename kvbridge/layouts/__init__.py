"""Layouts: the declarative description of a record (``registry``), the reference record codec
(``codec``), the non-finite byte scan (``scan``) and the registered families (``families``, all
imported with this package)."""

from kvbridge.layouts import families  # noqa: F401  (registers every layout)
from kvbridge.layouts.registry import Field, Layout, PageGeometry, Segment, all_layouts, get_layout, register

__all__ = ["Field", "Layout", "PageGeometry", "Segment", "all_layouts", "get_layout", "register"]
