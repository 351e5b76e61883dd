"""fairtick server package."""
