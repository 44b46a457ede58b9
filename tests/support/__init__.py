"""Helpers shared by the tests (``tests/`` is on the path via its conftest): ``from support.x import y``."""
