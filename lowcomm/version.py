"""The package's version, in one place: `lowcomm --version`, pyproject's metadata, the status page."""

__version__ = "0.1.0"
