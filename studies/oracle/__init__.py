"""The oracle study: see its README.md."""
