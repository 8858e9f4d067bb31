"""Model checking the real cores: simulated deployment, invariants, checker, seeded bugs."""
