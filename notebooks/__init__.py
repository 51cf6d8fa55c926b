"""Not code: a package only so that pytest imports notebooks/conftest.py as ``notebooks.conftest``,
leaving the module name ``conftest`` to tests/conftest.py, which the tests import from."""
