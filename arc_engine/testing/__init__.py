"""Test-only helpers: never imported by the library itself."""
