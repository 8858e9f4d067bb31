"""The sans-IO protocol cores: the tables' machines plus the rules between them, one Prefill
rank and one Decode rank, driven alike by the model checker and by the runtime."""
