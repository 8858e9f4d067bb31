"""The product's tools on top of both drivers: the CLI, the demo, the probe, the bench and
the trace validator's command."""
