"""Shared helpers of the benchmark scripts: an HTTP client for a running `fairtick serve`,
the admission measurement, window statistics, reports and plots. HTTP clients only: nothing
here loads a model; the only project import is the policy spec loader (to know which actions
the policy under test may take)."""
