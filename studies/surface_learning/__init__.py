"""The surface_learning study: see its README.md."""
