"""fairtick statemachine package."""
