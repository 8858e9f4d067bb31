"""The protocol machines declared as tables, the engine that runs them, diagrams, snapshot."""
