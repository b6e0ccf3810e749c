"""The version string, on the ground floor: every package may read it without importing ``transcover`` itself."""

__version__ = "0.1.0"
