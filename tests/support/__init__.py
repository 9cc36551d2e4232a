"""The tests' support code: fixtures (plugins named in tests/conftest.py) and helpers, a module each."""
