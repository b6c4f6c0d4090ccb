"""The surface_why study: see its README.md."""
