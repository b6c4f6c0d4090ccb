"""The learning study: see its README.md."""
