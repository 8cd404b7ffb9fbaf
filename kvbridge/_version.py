"""The package version, apart from the face so that modules inside may read it."""

__version__ = "0.1.0"
