"""fairtick runtime package."""
